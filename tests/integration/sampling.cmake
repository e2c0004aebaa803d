# Sampling controls end to end (test_sampling.py): penalties against the
# float64 torch reference on every grid, min_p / logit_bias / allowed ids /
# bad words / min_tokens / include_stop_str_in_output over HTTP, unknown
# fields ignored, bad input refused. Sorted after integration.cmake, whose
# loom_add_it it uses.
loom_add_it(it_sampling test_sampling.py)
# Constrained decoding end to end (test_structured.py): every spec kind on
# both routes, streamed or not; 50 generated schemas on tp 2; a constrained
# and free batch mix; bad specs; the three SDKs' structured-output calls.
loom_add_it(it_structured test_structured.py)
# The property test (test_structured_property.py): 250 generated schemas x 2
# seeds on 1x1, 2x1, 1x2 and 2x2, 24 requests at a time; every finished
# output validates, and a seed gives the same text on every grid.
loom_add_it(it_structured_property test_structured_property.py)
loom_add_it(it_tools test_tools.py)
# Chat templates end to end (test_chat_templates.py): real models' templates
# render as the python3-jinja2 reference does; forced tool calls in the
# model's own syntax; --reasoning-parser; bad templates and kwargs; the SDKs.
loom_add_it(it_chat_templates test_chat_templates.py --except test_forced_pythonic test_special_token)
# Forced calls in the pythonic, llama4_pythonic and qwen3_coder syntaxes;
# tool-call markers that are special tokens ([TOOL_CALLS], harmony's).
loom_add_it(it_chat_templates_forced test_chat_templates.py test_forced_pythonic test_special_token)
# Prompt logprobs and echo with logprobs (test_prompt_logprobs.py): against
# the float64 reference on every grid with chunked prefill, the openai SDK.
loom_add_it(it_prompt_logprobs test_prompt_logprobs.py)
