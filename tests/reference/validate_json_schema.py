#!/usr/bin/env python3
"""Validates constrained-decoding outputs: each line of FILE is
{"schema": ..., "output": "..."}; the output must parse as JSON and validate
against the schema (jsonschema, Draft 2020-12, formats checked). Exits 1 on
the first failures, printing them."""
import json
import sys

import jsonschema


def main():
    bad = 0
    n = 0
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
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
