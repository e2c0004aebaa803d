#!/usr/bin/env python3
"""Validates constrained-decoding outputs: each line of FILE is
{"schema": ..., "output": "..."}; the output must parse as JSON and validate
against the schema (jsonschema, Draft 2020-12, formats checked). Exits 1 on
the first failures, printing them."""
import copy
import datetime
import json
import re
import sys

import jsonschema

RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
TIME = re.compile(r"^\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


def make_checker():
    """The draft 2020-12 format checker, with date-time and time checked
    here too (Debian's jsonschema skips them without rfc3339-validator)."""
    checker = copy.deepcopy(jsonschema.Draft202012Validator.FORMAT_CHECKER)

    @checker.checks("date-time", raises=ValueError)
    def is_datetime(s):
        if not isinstance(s, str):
            return True
        if not RFC3339.match(s):
            return False
        datetime.datetime.fromisoformat(s.upper().replace("Z", "+00:00"))
        return True

    @checker.checks("time", raises=ValueError)
    def is_time(s):
        if not isinstance(s, str):
            return True
        return bool(TIME.match(s)) and is_datetime("1970-01-01T" + s)

    return checker


def main():
    bad = 0
    n = 0
    checker = make_checker()
    with open(sys.argv[1], encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            n += 1
            try:
                value = json.loads(rec["output"])
                jsonschema.Draft202012Validator(rec["schema"], format_checker=checker).validate(value)
            except (ValueError, jsonschema.ValidationError) as e:
                bad += 1
                if bad <= 5:
                    print("invalid output %r for schema %s: %s" % (rec["output"], json.dumps(rec["schema"]), e))
    print("validate_json_schema: %d outputs, %d invalid" % (n, bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
