#!/usr/bin/python3
"""Writes cases.json, the Jinja conformance corpus: each case is a template and
its vars; tests/reference/jinja_ref.py renders each with python's jinja2 and
with loom-jinja-render and wants the same bytes (or both refusing, with the
same raise_exception message). Edit the list here, then run this script."""
import json
import os

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b>"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  spaced  "}]
DATA = {"messages": MSGS, "n": 7, "f": 2.5, "neg": -3, "s": "Hello World", "empty": "", "none": None, "t": True,
        "lst": [3, 1, 2], "words": ["b", "A", "c", "a"], "d": {"b": 2, "a": 1, "c": None},
        "users": [{"name": "ann", "age": 30, "admin": True}, {"name": "Bob", "age": 25, "admin": False},
                  {"name": "cy", "age": 35}],
        "nested": {"x": {"y": [10, {"z": "deep"}]}}, "big": 12345678901, "fl": 0.1, "uni": "héllo wörld ✓"}

C = []


def case(name, template, vars=None, expect=None):
    c = {"name": name, "template": template, "vars": DATA if vars is None else vars}
    if expect:
        c["expect"] = expect
    C.append(c)


# --- text and whitespace control
case("text", "plain text")
case("trailing_newline", "a\n")
case("two_trailing_newlines", "a\n\n")
case("crlf", "a\r\nb\r\n{% if t %}\r\nc\r\n{% endif %}\r\n")
case("trim_blocks", "{% if t %}\nyes\n{% endif %}\nafter")
case("lstrip_blocks", "x\n    {% if t %}\n    y\n    {% endif %}\nz")
case("lstrip_not_var", "x\n    {{ n }}\n")
case("lstrip_plus", "x\n    {%+ if t %}y{% endif %}")
case("trim_plus", "{% if t +%}\nyes{% endif %}")
case("minus_left", "a   \n  {%- if t %}b{% endif %}")
case("minus_right", "{% if t -%}  \n\n  b{% endif %}")
case("var_minus", "a  {{- n -}}  b")
case("var_minus_newlines", "a\n\n{{- n }}\n\n{{ n -}}\n\nb")
case("comment", "a{# comment #}b")
case("comment_trim", "a\n{# c #}\nb")
case("comment_lstrip", "a\n   {# c #}\nb")
case("comment_minus", "a  {#- c -#}  b")
case("lstrip_midline", "a {% if t %}b{% endif %}")
case("lstrip_after_block", "{% if t %}\n  {% if t %}\nx\n  {% endif %}\n{% endif %}")
case("raw", "{% raw %}{{ not evaluated }} {% if %}{% endraw %}")
case("raw_minus", "a {%- raw -%}  {{ x }}  {%- endraw -%} b")
case("raw_newline", "{% raw %}\nx\n{% endraw %}\ny")
case("braces_in_text", "a { b } {x} c")
case("dict_in_var", "{{ {'a': {'b': 1}} }}")
case("tabs_lstrip", "x\n\t \t{% if t %}y{% endif %}")

# --- literals and Python repr
case("repr_list", "{{ [1, 'a', none, true, false, 1.5] }}")
case("repr_dict", "{{ {'a': none, 'b': [1, 2], 'c': 'x'} }}")
case("repr_tuple", "{{ (1, 2) }}{{ (1,) }}{{ () }}")
case("repr_quotes", "{{ [\"it's\", 'say \"hi\"', 'both \\' \"'] }}")
case("repr_escapes", "{{ ['a\\nb\\tc\\\\'] }}")
case("repr_none_bool", "{{ none }} {{ true }} {{ false }} {{ True }} {{ None }}")
case("floats", "{{ 1.0 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 1/3 }} {{ 10/2 }} {{ 1e16 }} {{ 1e-5 }} {{ 2.5e-3 }} {{ 123.456 }}")
case("float_vars", "{{ f }} {{ fl }} {{ f * 2 }} {{ [f, fl] }}")
case("ints", "{{ 42 }} {{ -7 }} {{ big }} {{ 1_000 }}")
case("string_escapes", "{{ 'a\\nb' }}|{{ \"tab\\there\" }}|{{ '\\u00e9\\x41' }}")
case("adjacent_strings", "{{ 'a' 'b' \"c\" }}")
case("unicode", "{{ uni }} {{ uni|length }} {{ uni[1] }} {{ uni[-1] }} {{ uni|upper }}")
case("print_dict_var", "{{ d }}")
case("print_list_of_dicts", "{{ users[:1] }}")

# --- arithmetic
case("arith", "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 7.5 // 2 }} {{ 7 / 2 }}")
case("arith_mixed", "{{ 1 + 2.0 }} {{ true + 1 }} {{ 3 * 1.5 }} {{ n - neg }} {{ -n }} {{ +n }}")
case("neg_literal_pow", "{{ -3 ** l[-1] }} {{ -3 ** 2 }} {{ -2.5 ** n }} {{ -n ** 2 }} {{ (-3) ** l[-1] }}", {"l": [2], "n": 2})
case("precedence", "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 10 - 2 - 3 }}")
case("str_mul", "{{ 'ab' * 3 }}{{ [1] * 2 }}{{ 3 * 'x' }}")
case("str_add", "{{ 'a' + 'b' }}{{ [1] + [2] }}")
case("concat_tilde", "{{ 'a' ~ 1 ~ none ~ true ~ [1] }}")
case("tilde_vs_plus", "{{ 1 + 2 ~ 3 }}")
case("percent_format", "{{ '%s-%d' % ('a', 3) }} {{ '%05.1f|%x|%r' % (3.14159, 255, 'q') }} {{ '%s' % 'one' }} {{ '%%' % () }}")
case("format_filter", "{{ '%s and %s'|format('a', 'b') }}")
case("str_format_method", "{{ '{} {}'.format(1, 'b') }} {{ '{0}{1}{0}'.format('x', 'y') }} {{ '{name}!'.format(name='n') }} {{ '{:>5}|{:<4}|{:^6}'.format('a', 'b', 'c') }} {{ '{:.2f}'.format(3.14159) }}")
case("div_zero", "{{ 1 / 0 }}", expect="error")
case("add_str_int", "{{ 'a' + 1 }}", expect="error")

# --- comparisons and logic
case("compare", "{{ 1 < 2 }} {{ 2 <= 1 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ 'a' != 'a' }} {{ [1, 2] < [1, 3] }}")
case("chain_compare", "{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }}")
case("paren_compare", "{{ (1 == 1) != (2 == 3) }}")
case("in", "{{ 'a' in 'cat' }} {{ 2 in lst }} {{ 'a' in d }} {{ 'z' not in d }} {{ 5 not in lst }}")
case("logic", "{{ true and 'x' }} {{ 0 or 'y' }} {{ not none }} {{ not 1 }} {{ '' or [] }} {{ n and none }}")
case("not_precedence", "{{ not 1 == 2 }} {{ not 'a' in 'b' }}")
case("condexpr", "{{ 'y' if t else 'n' }} {{ 'y' if none else 'n' }} [{{ 'y' if none }}]")
case("condexpr_nested", "{{ 'a' if n > 10 else 'b' if n > 5 else 'c' }}")
case("truthiness", "{% for v in [0, 1, '', 'x', [], [0], {}, none, 0.0] %}{{ 'T' if v else 'F' }}{% endfor %}")
case("lt_mixed", "{{ 1 < 'a' }}", expect="error")

# --- tests
case("tests_types", "{% for v in [1, 1.5, 'a', none, true, [1], {'a': 1}] %}"
     "{{ v is number }}{{ v is integer }}{{ v is float }}{{ v is string }}{{ v is none }}{{ v is boolean }}"
     "{{ v is mapping }}{{ v is iterable }}{{ v is sequence }};{% endfor %}")
case("tests_defined", "{{ x is defined }} {{ n is defined }} {{ x is undefined }} {{ none is defined }} {{ d.zz is defined }} {{ d.a is defined }}")
case("tests_true_false", "{{ true is true }} {{ 1 is true }} {{ false is false }} {{ 0 is false }}")
case("tests_num", "{{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(4) }}")
case("tests_eq", "{{ 1 is eq 1 }} {{ 'a' is equalto 'b' }} {{ 2 is in [1, 2] }} {{ 'x' is in 'xyz' }}")
case("tests_not", "{{ 1 is not string }} {{ n is not defined }}")
case("test_sameas", "{{ none is sameas none }} {{ true is sameas true }}")
case("test_lower_upper", "{{ 'abc' is lower }} {{ 'ABC' is upper }} {{ 'aB' is lower }}")
case("tests_callable", "{{ range is callable }} {{ n is callable }}")

# --- variables, attributes, items
case("getattr_dict", "{{ nested.x.y[1].z }} {{ nested['x']['y'][0] }} {{ users[1].name }} {{ users.1.name }}")
case("getattr_missing", "[{{ d.zz }}][{{ d['zz'] }}][{{ lst[10] }}][{{ s.nope }}]")
case("undefined_print", "[{{ nothing }}]")
case("undefined_attr_error", "{{ nothing.attr }}", expect="error")
case("undefined_call_error", "{{ nothing() }}", expect="error")
case("undefined_iter", "{% for x in nothing %}x{% endfor %}done")
case("undefined_filters", "[{{ nothing|first }}][{{ nothing|list }}][{{ nothing|join(',') }}][{{ nothing|length }}][{{ nothing|default(1) }}]")
case("undefined_upper", "[{{ nothing|upper }}][{{ nothing|string }}]")
case("undefined_concat", "[{{ nothing ~ 'a' }}]")
case("none_attr", "[{{ none.x }}]")
case("dict_method_shadow", "{{ {'items': 1}['items'] }} {{ {'values': 5}.get('values') }}")
case("negative_index", "{{ lst[-1] }} {{ s[-1] }} {{ s[0] }}")
case("slices", "{{ lst[1:] }} {{ lst[:-1] }} {{ lst[::-1] }} {{ s[::2] }} {{ s[3:1:-1] }} {{ s[-3:] }} {{ s[:100] }} {{ lst[5:] }}")
case("slice_huge_steps", "{{ [1, 2, 3][1::9223372036854775807] }}{{ 'abc'[2::-9223372036854775807] }}{{ [1, 2][-9223372036854775807:9223372036854775807] }}")
case("format_huge_width", "{{ '{:99999999999999999999}'.format(1)|length > 0 }}", expect="error")
case("slice_messages", "{% for m in messages[1:] %}{{ m.role }},{% endfor %}")
case("list_unsafe_append", "{% set l = [1] %}{{ l.append(2) }}", expect="error")
case("dict_unsafe_update", "{% set x = {} %}{{ x.update({'a': 1}) }}", expect="error")

# --- set and scoping
case("set_simple", "{% set x = 5 %}{{ x }}{% set x = x + 1 %}{{ x }}")
case("set_tuple", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c, e = [3, 4] %}{{ c }}{{ e }}")
case("set_tuple_value", "{% set t = 1, 2 %}{{ t }}")
case("set_block", "{% set x %}inner {{ n }}{% endset %}[{{ x }}]")
case("set_block_filter", "{% set x | upper %}abc{% endset %}{{ x }}")
case("set_in_loop_no_leak", "{% set x = 0 %}{% for i in range(3) %}{{ x }}{% set x = i %}{{ x }}{% endfor %}|{{ x }}")
case("set_in_loop_iteration_scope", "{% for i in range(3) %}{% if i == 1 %}{% set y = 5 %}{% endif %}[{{ y }}]{% endfor %}")
case("set_block_scope", "{% set x %}{% set inner = 1 %}{{ inner }}{% endset %}[{{ inner }}][{{ x }}]")
case("filter_block_scope", "{% filter upper %}{% set inner = 'a' %}{{ inner }}{% endfilter %}[{{ inner }}]")
case("set_in_if_leaks", "{% if t %}{% set x = 1 %}{% endif %}{{ x }}")
case("namespace", "{% set ns = namespace(count=0, found=false) %}{% for u in users %}{% set ns.count = ns.count + 1 %}"
     "{% if u.admin %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.count }} {{ ns.found }}")
case("namespace_dict_arg", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}")
case("namespace_cycle", "{% set ns = namespace(a=1) %}{% set ns.x = [ns] %}{{ ns }} {{ ns.x }}")
case("namespace_missing", "[{{ namespace().x }}]")
case("set_attr_not_namespace", "{% set d2 = {} %}{% set d2.x = 1 %}", expect="error")
case("set_nested_loops", "{% set ns = namespace(s='') %}{% for a in [1, 2] %}{% for b in 'xy' %}{% set ns.s = ns.s ~ a ~ b %}{% endfor %}{% endfor %}{{ ns.s }}")
case("loop_var_after_loop", "{% for i in [1, 2] %}{% endfor %}[{{ i }}]")
case("dict_global", "{{ dict(a=1, b='x') }} {{ dict({'k': 1}, z=2) }}")

# --- for loops
case("for_basic", "{% for x in lst %}{{ x }},{% endfor %}")
case("for_loop_vars", "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
     "{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}")
case("for_prev_next", "{% for x in lst %}[{{ loop.previtem }}|{{ loop.nextitem }}]{% endfor %}")
case("for_prev_defined", "{% for x in lst %}{{ loop.previtem is defined }}{% endfor %}")
case("for_cycle", "{% for x in range(5) %}{{ loop.cycle('a', 'b', 'c') }}{% endfor %}")
case("for_else", "{% for x in [] %}x{% else %}empty{% endfor %}")
case("for_else_break_first", "{% for x in [1, 2, 3] %}{{ x }}{% break %}{% else %}ELSE{% endfor %}")
case("for_else_break_later", "{% for x in [1, 2, 3] %}{{ x }}{% if x == 2 %}{% break %}{% endif %}{% else %}ELSE{% endfor %}")
case("for_else_all_continue", "{% for x in [1, 2, 3] %}{{ x }}{% continue %}{% else %}ELSE{% endfor %}")
case("for_else_scope", "{% set i = 5 %}{% for i in [] %}{% else %}{{ i }}{% set a = 1 %}{% endfor %}[{{ a }}]")
case("for_else_filtered", "{% for x in lst if x > 5 %}x{% else %}none{% endfor %}")
case("for_if", "{% for u in users if u.age > 26 %}{{ u.name }}{{ loop.index }}/{{ loop.length }} {% endfor %}")
case("for_dict", "{% for k in d %}{{ k }}{% endfor %}")
case("for_items", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}")
case("for_items_filter", "{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}")
case("for_dictsort", "{% for k, v in d|dictsort %}{{ k }}={{ v }};{% endfor %}")
case("for_string", "{% for c in uni %}{{ c }}.{% endfor %}")
case("for_nested_loop", "{% for a in [1, 2] %}{% for b in [3, 4] %}{{ loop.index }}{% endfor %}{{ loop.index }}|{% endfor %}")
case("for_break", "{% for x in range(10) %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %}")
case("for_continue", "{% for x in range(6) %}{% if x is odd %}{% continue %}{% endif %}{{ x }}{% endfor %}")
case("for_range", "{{ range(3)|list }} {{ range(1, 10, 3)|list }} {{ range(5, 0, -2)|list }} {{ range(0)|list }}")
case("for_range_print", "{% for i in range(2, 4) %}{{ i }}{% endfor %}")
case("for_tuple_unpack", "{% for a, b in [(1, 2), (3, 4)] %}{{ a + b }}{% endfor %}")
case("for_filter_iterable", "{% for w in words|sort %}{{ w }}{% endfor %}")
case("for_over_int", "{% for x in 5 %}{% endfor %}", expect="error")
case("for_messages", "{% for m in messages %}{% if loop.first and m.role == 'system' %}S:{{ m.content }}\n"
     "{% elif m.role == 'user' %}U:{{ m.content|trim }}\n{% else %}A:{{ m.content }}\n{% endif %}{% endfor %}")

# --- if
case("if_elif_else", "{% for v in [1, 5, 10] %}{% if v < 3 %}small{% elif v < 7 %}mid{% else %}big{% endif %} {% endfor %}")
case("if_nested", "{% if t %}{% if n > 3 %}a{% else %}b{% endif %}{% endif %}")
case("if_undefined", "{% if nothing %}y{% else %}n{% endif %}")
case("if_tests", "{% if messages[0].role == 'system' and messages|length > 1 %}ok{% endif %}")

# --- macros and call
case("macro", "{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('A') }} {{ greet('B', 'Hi') }} {{ greet(name='C', greeting='Yo') }}")
case("macro_missing_arg", "{% macro m(a, b) %}[{{ a }}|{{ b }}]{% endmacro %}{{ m(1) }}")
case("macro_varargs", "{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, x=4) }}")
case("macro_caller", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold {{ n }}{% endcall %}")
case("macro_caller_args", "{% macro each(items) %}{% for i in items %}{{ caller(i) }}{% endfor %}{% endmacro %}{% call(x) each([1, 2]) %}<{{ x }}>{% endcall %}")
case("macro_recursive", "{% macro fact(k) %}{% if k <= 1 %}1{% else %}{{ k * fact(k - 1)|int }}{% endif %}{% endmacro %}{{ fact(5) }}")
case("macro_scope", "{% set x = 'outer' %}{% macro m() %}{% set x = 'inner' %}{{ x }}{% endmacro %}{{ m() }} {{ x }}")
case("macro_sees_globals", "{% macro m() %}{{ n }}{% endmacro %}{{ m() }}")
case("macro_default_uses_arg", "{% macro m(a, b=a ~ '!') %}{{ b }}{% endmacro %}{{ m('x') }}")
case("macro_trim", "{% macro m() %}\n  line\n{% endmacro %}[{{ m() }}]")
case("macro_render_json", "{%- macro render(v) -%}{%- if v is mapping -%}{ {%- for k, x in v.items() -%}{{ k }}:{{ render(x) }}{{ ',' if not loop.last }}{%- endfor -%} }{%- elif v is string -%}\"{{ v }}\"{%- else -%}{{ v }}{%- endif -%}{%- endmacro -%}{{ render(nested) }}")

# --- filter blocks
case("filter_block", "{% filter upper %}shout {{ s }}{% endfilter %}")
case("filter_block_chain", "{% filter trim|replace('a', 'o') %}  banana  {% endfilter %}")

# --- filters
case("f_trim", "[{{ '  x  '|trim }}][{{ 'xxaxx'|trim('x') }}][{{ messages[3].content|trim }}]")
case("f_case", "{{ s|upper }} {{ s|lower }} {{ 'hello world-foo (bar)'|title }} {{ 'hELLO wORLD'|capitalize }}")
case("f_replace", "{{ s|replace('o', '0') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 'ab'|replace('', '-') }}")
case("f_length", "{{ lst|length }} {{ s|length }} {{ d|length }} {{ lst|count }} {{ nothing|length }}")
case("f_first_last", "{{ lst|first }} {{ lst|last }} {{ s|first }} {{ s|last }} [{{ []|first }}]")
case("f_join", "{{ lst|join(', ') }} {{ words|join }} {{ users|join(', ', attribute='name') }} {{ [1, none, 'a']|join('-') }}")
case("f_default", "{{ nothing|default('dflt') }} {{ none|default('dflt') }} [{{ empty|default('dflt') }}] {{ empty|default('dflt', true) }} {{ nothing|d('x') }} {{ 0|d(5, boolean=true) }}")
case("f_list", "{{ 'abc'|list }} {{ d|list }} {{ lst|list }}")
case("f_items", "{{ d|items|list }}")
case("f_selectattr", "{{ users|selectattr('admin')|map(attribute='name')|list }} {{ users|rejectattr('admin')|map(attribute='name')|list }}")
case("f_selectattr_test", "{{ users|selectattr('age', 'gt', 26)|map(attribute='name')|join(',') }} {{ users|selectattr('name', 'equalto', 'ann')|list|length }} {{ users|selectattr('admin', 'defined')|list|length }}")
case("f_select", "{{ [0, 1, 2, 3]|select|list }} {{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3]|reject('even')|list }} {{ lst|select('greaterthan', 1)|list }}")
case("f_map", "{{ words|map('upper')|list }} {{ users|map(attribute='age')|list }} {{ users|map(attribute='zz', default='?')|list }} {{ ['1', '2']|map('int')|sum }}")
case("f_map_nested_attr", "{{ [nested, nested]|map(attribute='x.y.0')|list }}")
case("f_reverse", "{{ lst|reverse|list }} {{ s|reverse }}")
case("f_sort", "{{ lst|sort }} {{ words|sort }} {{ words|sort(case_sensitive=true) }} {{ lst|sort(reverse=true) }} {{ users|sort(attribute='age')|map(attribute='name')|list }}")
case("f_sort_stable", "{{ [{'k': 1, 'v': 'a'}, {'k': 0, 'v': 'b'}, {'k': 1, 'v': 'c'}]|sort(attribute='k')|map(attribute='v')|join }}")
case("f_unique", "{{ [1, 2, 1, 3, 2]|unique|list }} {{ ['a', 'A', 'b']|unique|list }} {{ ['a', 'A']|unique(case_sensitive=true)|list }}")
case("f_string", "{{ 1|string ~ 'x' }} {{ none|string }} {{ lst|string }}")
case("f_int_float", "{{ '42'|int }} {{ '3.7'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.9|int }} {{ '2.5'|float }} {{ 3|float }} {{ 'y'|float }} {{ '0x1A'|int(0, 16) }} {{ true|int }}")
case("f_round", "{{ 2.5|round }} {{ 3.14159|round(2) }} {{ 2.7|round(method='floor') }} {{ 2.1|round(0, 'ceil') }} {{ 7|round }} {{ 1.005|round(2) }}")
case("f_abs", "{{ -3|abs }} {{ neg|abs }} {{ -2.5|abs }}")
case("f_indent", "{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(2, blank=true) }}|{{ 'x\\ny'|indent('> ') }}")
case("f_indent_trailing", "[{{ 'a\\n'|indent(3) }}][{{ '{\\n'|indent(4, first=true) }}]")
case("f_dictsort", "{{ {'b': 1, 'A': 2, 'c': 0}|dictsort }} {{ {'b': 1, 'a': 2}|dictsort(by='value') }} {{ {'b': 1, 'a': 2}|dictsort(reverse=true) }}")
case("f_escape", "{{ '<a href=\"x\">&\\'</a>'|e }} {{ '<b>'|escape }} {{ '<b>'|safe }}")
case("f_tojson", "{{ d|tojson }} {{ 'é\"\\n'|tojson }} {{ [1, 2.5, none, true]|tojson }} {{ {}|tojson }} {{ []|tojson }}")
case("f_tojson_indent", "{{ nested|tojson(indent=2) }}\n{{ {'a': [1, {'b': []}]}|tojson(indent=4) }}")
case("f_tojson_args", "{{ d|tojson(sort_keys=true) }} {{ d|tojson(separators=(',', ':')) }} {{ users[0]|tojson(indent=2, sort_keys=true) }}")
case("f_tojson_tools", "{% for m in messages %}{{ m|tojson }}\n{% endfor %}")
case("f_batch", "{{ [1, 2, 3, 4, 5]|batch(2)|list }} {{ [1, 2, 3]|batch(2, 0)|list }}")
case("f_wordcount", "{{ 'hello big world'|wordcount }} {{ s|wordcount }}")
case("f_min_max_sum", "{{ lst|min }} {{ lst|max }} {{ lst|sum }} {{ users|sum(attribute='age') }} {{ words|min }} {{ [1.5, 2]|sum }}")
case("f_attr", "{{ users[0]|attr('name') }}")
case("f_center", "[{{ 'ab'|center(7) }}][{{ 'abc'|center(8) }}]")
case("f_chain", "{{ messages|map(attribute='role')|unique|join('/')|upper }}")
case("f_unknown", "{{ 1|nosuchfilter }}", expect="error")

# --- methods
case("m_startswith", "{{ s.startswith('Hell') }} {{ s.endswith('x') }} {{ s.startswith(('x', 'H')) }}")
case("m_split", "{{ 'a,b,,c'.split(',') }} {{ '  a  b c '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a b  c'.split(maxsplit=1) }} {{ 'a,b,c'.rsplit(',', 1) }}")
case("unicode_space", "[{{ u|trim }}][{{ u.strip() }}][{{ u.split() }}][{{ u.split(maxsplit=1) }}][{{ u.rstrip() }}][{{ ws.isspace() }}][{{ u|wordcount }}]",
     {"u": "\u3000\u00a0hello\u2003wide\u00a0world\u202f\u2028", "ws": "\u00a0 \u3000"})
case("repr_unicode_escapes", "{{ [s] }}", {"s": "a\u00adb\u200bc\u2060d\ufeffe\u0085f\u00e9\u4e2d\U0001f600\x7f\x1b"})
case("split_maxsplit_trailing", "{{ '  a b  c  '.split(None, 1) }}{{ ' a  b '.split(maxsplit=0) }}")
case("unicode_lines", "{{ s|indent(2) }}|{{ s.splitlines() }}|{{ s|indent(2, true, true) }}", {"s": "a\u2028b\u2029c\u0085d\x1ce\r\nf\rg\x0bh\x0ci\n"})
case("m_strip", "[{{ '  x '.strip() }}][{{ 'xyx'.strip('x') }}][{{ '  x '.lstrip() }}][{{ '  x '.rstrip() }}][{{ 'abc'.rstrip('c') }}]")
case("m_replace", "{{ s.replace('l', 'L') }} {{ s.replace('l', 'L', 1) }}")
case("m_case", "{{ s.upper() }} {{ s.lower() }} {{ 'hello wORLD'.title() }} {{ 'x1y'.title() }} {{ 'hello'.capitalize() }} {{ 'aB'.swapcase() }}")
case("m_find_count", "{{ s.find('o') }} {{ s.find('z') }} {{ s.rfind('o') }} {{ s.count('l') }} {{ s.index('W') }}")
case("m_join", "{{ '-'.join(['a', 'b']) }} {{ ', '.join(words) }}")
case("m_is", "{{ '123'.isdigit() }} {{ 'ab'.isalpha() }} {{ ' '.isspace() }} {{ 'a1'.isalnum() }} {{ ''.isdigit() }}")
case("m_dict", "{{ d.keys()|list }} {{ d.values()|list }} {{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 9) }} {{ d.items()|list }}")
case("m_list", "{{ lst.index(1) }} {{ [1, 1, 2].count(1) }}")
case("m_splitlines", "{{ 'a\\nb\\r\\nc'.splitlines() }}")
case("m_on_none", "{{ none.strip() }}", expect="error")
case("m_content_none", "{{ messages[0].content.strip() }}|{{ messages[1]['content'].split(' ')[0] }}")

# --- globals
case("raise_exception", "{% if n > 3 %}{{ raise_exception('n is too big: ' ~ n) }}{% endif %}", expect="error")
case("raise_exception_in_loop", "{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('No assistant: ' + m.content) }}{% endif %}{% endfor %}", expect="error")
case("raise_in_macro", "{% macro check(x) %}{% if not x %}{{ raise_exception('empty!') }}{% endif %}ok{% endmacro %}{{ check(1) }}{{ check(0) }}", expect="error")
case("strftime_defined", "{{ strftime_now is defined }} {{ strftime_now('%Y')|length }}")
case("range_too_big", "{{ range(200000)|length }}", expect="error")
case("range_step_zero", "{{ range(1, 2, 0) }}", expect="error")

# --- syntax errors (both refuse)
case("err_unclosed_if", "{% if t %}x", expect="error")
case("err_unclosed_for", "{% for x in lst %}x", expect="error")
case("err_unclosed_var", "{{ x ", expect="error")
case("err_bad_endif", "{% endif %}", expect="error")
case("err_unknown_tag", "{% frobnicate %}", expect="error")
case("err_bad_expr", "{{ 1 + }}", expect="error")
case("err_unclosed_string", "{{ 'abc }}", expect="error")
case("err_unknown_test", "{{ 1 is frob }}", expect="error")
case("err_unclosed_comment", "{# abc", expect="error")
case("err_extra_endfor", "{% for x in lst %}{% endfor %}{% endfor %}", expect="error")

# --- chat-template idioms
case("idiom_system_split", "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
     "{%- else %}{%- set loop_messages = messages %}{%- endif %}{{ system_message }}|{% for m in loop_messages %}{{ m.role[0] }}{% endfor %}")
case("idiom_alternate", "{% for message in messages[1:] %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
     "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% endfor %}ok")
case("idiom_alternate_fail", "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
     "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% endfor %}ok", expect="error")
case("idiom_gen_prompt", "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
     dict(DATA, add_generation_prompt=True))
case("idiom_bos", "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{% endfor %}{{ eos_token }}", dict(DATA, bos_token="<s>", eos_token="</s>"))
case("idiom_tools_json", "{%- for tool in tools %}{{- tool | tojson(indent=4) }}\n\n{%- endfor %}",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}]})
case("idiom_tool_call_args", "{%- for tc in calls %}{{ tc.function.arguments | tojson }}|{{ tc.function.arguments is string }}{% endfor %}",
     {"calls": [{"function": {"name": "f", "arguments": {"x": 1, "y": "é"}}}, {"function": {"name": "g", "arguments": "{\"a\": 1}"}}]})
case("idiom_content_list", "{%- for m in msgs %}{%- if m.content is string %}{{ m.content }}{%- else %}{%- for c in m.content %}{%- if c.type == 'text' %}{{ c.text }}{%- elif c.type == 'image' %}<img>{%- endif %}{%- endfor %}{%- endif %}\n{%- endfor %}",
     {"msgs": [{"content": "plain"}, {"content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}]})
case("idiom_think_split", "{%- set content = msg.content %}{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
     "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}[{{ reasoning }}][{{ content }}]",
     {"msg": {"content": "<think>\nhmm\n</think>\n\nanswer"}})
case("idiom_ns_last_user", "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{{ ns.last }}")
case("idiom_reverse_loop", "{%- for m in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}{{ index }}{{ m.role[0] }} {% endfor %}")
case("idiom_date", "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}{{ date_string }}")
case("idiom_default_system", "{{ (messages|selectattr('role', 'equalto', 'system')|list|first).content|default('none') }}")

# --- odds and ends: precedence, printing, loop.changed, range objects, joins
EXTRA_VARS = {"msgs": [1, 2, 3], "d": {"a": 1}}
case('misc_00', "{{ 'a' < 'B' }}{{ -1 ** 2 }}{{ (-1) ** 2 }}", EXTRA_VARS)
case('misc_01', '{% set x = [] %}{% for i in range(3) %}{% set x = x + [i] %}{% endfor %}{{ x }}', EXTRA_VARS)
case('misc_02', "{{ '%.2f'|format(3.14159) }}{{ 3|string|length }}{{ ('a', 'b')|join }}", EXTRA_VARS)
case('misc_03', "{{ {'a': 1, 'a': 2} }}", EXTRA_VARS)
case('misc_04', '{{ x.y is defined }}', EXTRA_VARS)
case('misc_05', '{% for m in msgs if m != 2 %}{{ loop.last }}{% endfor %}', EXTRA_VARS)
case('misc_06', '{{ loop }}', EXTRA_VARS)
case('misc_07', '{% for i in [1,2] %}{{ loop.changed(i) }}{% endfor %}', EXTRA_VARS)
case('misc_08', "{{ 1 if true }}{{ [1,2,3]|last }}{{ 'ab'|list|last }}", EXTRA_VARS)
case('misc_09', '{{ none is none }}{{ none == none }}{{ none|string|lower }}', EXTRA_VARS)
case('misc_10', "{{ [3,1]|sort|first }}{{ {'b':1,'a':2}|dictsort|first }}", EXTRA_VARS)
case('misc_11', '{{ 5 // 0.5 }}{{ 5 % 2.5 }}{{ 2 ** 0.5 }}{{ 1e300 * 1e10 }}', EXTRA_VARS)
case('misc_12', '{{ range(3) }}', EXTRA_VARS)
case('misc_13', "{{ d['a'] }}{{ d.a.b }}", EXTRA_VARS)
case('misc_14', "{{ [1, [2, {'a': (3, none)}]] }}", EXTRA_VARS)
case('misc_15', "{{ 'x'|trim|title }}{{ ''|title }}{{ 'hello-world foo'|title }}", EXTRA_VARS)
case('misc_16', '{{ 0.0 }}{{ -0.0 }}{{ 100.0 }}{{ 1.5e-7 }}{{ 12345678.9 }}{{ 1e15 }}{{ 123456789012345680.0 }}', EXTRA_VARS)
case('misc_17', "{{ true * 3 }}{{ false ~ '' }}", EXTRA_VARS)
case('misc_18', "{{ [1,2] == [1,2] }}{{ (1,2) == [1,2] }}{{ {'a':1} == {'a':1} }}", EXTRA_VARS)
case('misc_19', "{% set a = {'k': [1]} %}{{ a.k|length }}{{ a['k'][0] }}", EXTRA_VARS)
case('misc_20', "{{ 'a\\\\nb' }}|{{ '\\'' }}", EXTRA_VARS)
case('misc_21', '{% if true %}a{% elif x.y %}b{% endif %}', EXTRA_VARS)
case('misc_22', "{{ [] is sequence }}{{ '' is iterable }}{{ 1 is iterable }}{{ none is mapping }}", EXTRA_VARS)
case('misc_23', '{%- for i in range(3) -%}\n  {{ i }}\n{%- endfor -%}', EXTRA_VARS)
case('misc_24', 'a\n{%- if true %}\nb\n{%- endif %}\nc', EXTRA_VARS)
case('misc_25', "{{ 'a' ~ 1.0 }}{{ 7 / 7 }}{{ 2 * 0.5 }}", EXTRA_VARS)
case('misc_26', "{{ ['a','b']|map('upper')|join }}{{ [1,2]|map('string')|join('-') }}", EXTRA_VARS)
case('misc_27', "{{ [{'a': 1}, {'a': 2}]|map(attribute='a')|max }}", EXTRA_VARS)
case('misc_28', "{{ 'Hello'[1:3] }}{{ 'Hello'[:-10] }}{{ [1,2,3][-2:] }}", EXTRA_VARS)
case('misc_29', "{{ 'a,b'.split(',')|tojson }}{{ ('a', 1)|tojson }}", EXTRA_VARS)
case('misc_30', '{{ 1.0|tojson }}{{ 1e20|tojson }}{{ 0.5|tojson }}', EXTRA_VARS)
case('misc_31', "{{ {'a': 'é'}|tojson(ensure_ascii=false) }}", EXTRA_VARS)
case('misc_32', "{{ {1: 'a'}|tojson }}{{ {1: 'a'} }}", EXTRA_VARS)
case('misc_33', '{% macro m() %}{{ caller is defined }}{% endmacro %}{{ m() }}', EXTRA_VARS)
case('misc_34', '{% for a in [[1,2],[3,4]] %}{% for b in a %}{{ loop.index }}{{ b }}{% endfor %}{% endfor %}', EXTRA_VARS)
case('misc_35', "{{ 'abc'|replace('b', none) }}", EXTRA_VARS)
case('misc_36', "{{ ['b','a']|sort|join }}{{ [2, 1.5, true]|sort }}", EXTRA_VARS)
case('misc_37', "{{ 'ABC'|lower is lower }}", EXTRA_VARS)
case('misc_38', '{{ x|default }}|{{ none|default }}', EXTRA_VARS)
case('misc_39', "{{ '  '.join(['a']) }}{{ ','.join([1,2]) }}", EXTRA_VARS)

# --- macro scoping and arguments
case('macro_scope_00', '{% macro m() %}{{ x }}{% endmacro %}{% set x = 1 %}{{ m() }}', {})
case('macro_scope_01', '{% set x = 0 %}{% macro m() %}{{ x }}{% endmacro %}{% set x = 1 %}{{ m() }}', {})
case('macro_scope_02', '{% for i in [1,2] %}{% macro m() %}{{ i }}{% endmacro %}{{ m() }}{% endfor %}', {})
case('macro_scope_03', '{% macro m() %}{{ loop is defined }}{% endmacro %}{% for i in [1] %}{{ m() }}{% endfor %}', {})
case('macro_scope_04', '{% macro m(x) %}{% set y = x %}{{ y }}{% endmacro %}{% set y = 5 %}{{ m(1) }}{{ y }}', {})
case('macro_scope_05', '{% for i in [1,2] %}{% set x = i %}{% macro m() %}{{ x }}{% endmacro %}{{ m() }}{% endfor %}', {})
case('macro_scope_06', '{% macro outer() %}{% macro inner() %}in{% endmacro %}{{ inner() }}{% endmacro %}{{ outer() }}[{{ inner is defined }}]', {})
case('macro_scope_07', '{% macro m() %}{{ caller is defined }}{% endmacro %}{{ m() }}', {})
case('macro_scope_08', '{% macro m(a) %}{{ a }}{{ varargs|length }}{% endmacro %}{{ m() }}', {})
case('macro_scope_09', '{% macro m() %}{{ m2() }}{% endmacro %}{% macro m2() %}two{% endmacro %}{{ m() }}', {})
case('macro_scope_10', '{% set ns = namespace(v=1) %}{% macro m() %}{% set ns.v = ns.v + 1 %}{% endmacro %}{{ m() }}{{ m() }}{{ ns.v }}', {})
case('macro_scope_11', '{% macro m() %}{{ x }}{% endmacro %}{% if true %}{% set x = 3 %}{% endif %}{{ m() }}', {})
case('macro_scope_12', '{% macro m(a, b) %}{{ a }}{{ b }}{% endmacro %}{{ m(1, 2, 3) }}', {}, expect="error")
case('macro_scope_13', '{% macro m(a) %}{{ a }}{% endmacro %}{{ m(a=1, z=2) }}', {}, expect="error")

os.chdir(os.path.dirname(os.path.abspath(__file__)))
with open("cases.json", "w", encoding="utf-8") as f:
    f.write('{"cases": [\n')
    f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in C))
    f.write("\n]}\n")
print(f"{len(C)} cases")
