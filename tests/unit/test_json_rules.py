"""The server's JSON rules: numbers without bounds get finite ones; the schema's own bounds win."""

from __future__ import annotations

from handler.engine.core.json_rules import INTEGER_LIMIT, NUMBER_LIMIT, apply_json_rules


def test_unbounded_integers_and_numbers_get_bounds_everywhere_in_the_schema() -> None:
    schema = {"type": "object", "properties": {
        "population": {"type": "integer"},
        "ratio": {"type": "number"},
        "either": {"type": ["integer", "null"]},
        "scores": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
    }, "$defs": {"n": {"type": "number", "exclusiveMinimum": 0}}}
    bounded = apply_json_rules(schema)
    props = bounded["properties"]
    assert (props["population"]["minimum"], props["population"]["maximum"]) == (-INTEGER_LIMIT, INTEGER_LIMIT)
    assert (props["ratio"]["minimum"], props["ratio"]["maximum"]) == (-NUMBER_LIMIT, NUMBER_LIMIT)
    assert props["either"]["maximum"] == INTEGER_LIMIT
    assert props["scores"]["items"]["anyOf"][0]["maximum"] == INTEGER_LIMIT
    assert "maximum" not in props["scores"]["items"]["anyOf"][1]
    assert bounded["$defs"]["n"] == {"type": "number", "exclusiveMinimum": 0, "maximum": NUMBER_LIMIT}
    assert "minimum" not in schema["properties"]["population"]  # a copy: the request's schema is left alone
    assert bounded["additionalProperties"] is False


def test_an_object_keeps_its_own_additional_properties_rule() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}
    assert apply_json_rules(schema) == schema


def test_the_schema_own_bounds_and_values_are_left_alone() -> None:
    schema = {"type": "integer", "minimum": 0, "maximum": 10, "enum": [{"type": "integer"}], "default": 3}
    assert apply_json_rules(schema) == schema
