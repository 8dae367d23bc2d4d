"""Does constrained JSON terminate with a small model? A fixed set of schemas (objects, arrays, enums, nested,
numbers) sent to a running server with ``response_format: json_schema``, greedy; counts the answers that end with
``finish_reason: stop`` and validate against their schema.

    python -m bench.json_schemas --url http://127.0.0.1:8080 [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json

import jsonschema
import requests

CASES = [
    ("Describe the city of Paris.", {"type": "object", "properties": {
        "city": {"type": "string"}, "population": {"type": "integer"}}, "required": ["city", "population"]}),
    ("Give the height of Mount Everest.", {"type": "object", "properties": {
        "mountain": {"type": "string"}, "height_m": {"type": "number"}}, "required": ["mountain", "height_m"]}),
    ("List three primary colours.", {"type": "object", "properties": {
        "colours": {"type": "array", "items": {"type": "string"}}}, "required": ["colours"]}),
    ("Is the sky blue? Answer with a verdict.", {"type": "object", "properties": {
        "verdict": {"enum": ["yes", "no", "unsure"]}}, "required": ["verdict"]}),
    ("Describe a person named Alice who is 30.", {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["city", "zip"]}}, "required": ["name", "age", "address"]}),
    ("Give the first five square numbers.", {"type": "object", "properties": {
        "squares": {"type": "array", "items": {"type": "integer"}}}, "required": ["squares"]}),
    ("What is the temperature in London in Celsius?", {"type": "object", "properties": {
        "celsius": {"type": "number"}, "fahrenheit": {"type": "number"}}, "required": ["celsius", "fahrenheit"]}),
    ("Rate this movie from 1 to 5: 'A great film.'", {"type": "object", "properties": {
        "stars": {"type": "integer"}, "summary": {"type": "string"}}, "required": ["stars", "summary"]}),
    ("Count the legs of a spider.", {"type": "object", "properties": {"legs": {"type": "integer"}},
                                      "required": ["legs"]}),
    ("Give the price of a coffee in euros.", {"type": "object", "properties": {
        "item": {"type": "string"}, "price": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}},
        "required": ["item", "price", "currency"]}),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    good = 0
    for prompt, schema in CASES:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
                "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
        choice = requests.post(f"{args.url}/v1/chat/completions", json=body, timeout=600).json()["choices"][0]
        text = choice["message"]["content"]
        try:
            jsonschema.validate(json.loads(text), schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        ok = valid and choice["finish_reason"] == "stop"
        good += ok
        print(f"{'ok ' if ok else 'BAD'} {choice['finish_reason']:6} {text[:90]!r}")
    print(f"{good}/{len(CASES)} ended with stop and validate")


if __name__ == "__main__":
    main()
