"""The server's JSON rules for constrained output (``response_format`` schemas and forced tool-call arguments).

A small model constrained to a schema can loop inside it: an unbounded integer lets it write ``111111...`` until
``max_tokens`` (seen with the embedded model for ``{"population": integer}``), free whitespace lets it indent for
ever. So, unless the schema says otherwise:
- JSON is laid out on one line with json.dumps' separators (``JSON_LAYOUT``);
- an integer is within I-JSON's interoperable range, ±(2**53 - 1) (RFC 7493; also what JavaScript clients can
  read exactly), so at most 16 digits;
- a number's magnitude is at most 1e15 (its fraction digits stay free: JSON Schema cannot bound them);
- an object with ``properties`` has no others unless ``additionalProperties`` says so (OpenAI's strict mode and
  xgrammar's default; measured: ``{"city", "population"}`` got "capital", "land", "name", ... until max_tokens).
A schema's own ``minimum`` / ``maximum`` (or exclusive ones) and ``additionalProperties`` always win.
"""

from __future__ import annotations

JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
INTEGER_LIMIT = 2**53 - 1
NUMBER_LIMIT = 1e15
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples", "required", "x-guidance"})


def apply_json_rules(schema: object) -> object:
    """A copy of the schema with the rules above added wherever an integer, a number or an object has none."""
    if isinstance(schema, list):
        return [apply_json_rules(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    bounded = {key: value if key in _NOT_SCHEMAS else apply_json_rules(value) for key, value in schema.items()}
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types}
    limit = INTEGER_LIMIT if "integer" in types and "number" not in types else NUMBER_LIMIT
    if "properties" in schema and "additionalProperties" not in schema:
        bounded["additionalProperties"] = False
    if types & {"integer", "number"}:
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            bounded["minimum"] = -limit
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            bounded["maximum"] = limit
    return bounded
