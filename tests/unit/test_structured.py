"""response_format / tools / tool_choice -> the grammar the engine enforces and the format the formatter parses."""

from __future__ import annotations

import json

import pytest

from handler.errors import BadRequest
from handler.protocol.structured import NamedToolChoice, ResponseFormat, Tool, plan_output

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def tools(*definitions: dict) -> list[Tool]:
    return [Tool.model_validate(d) for d in definitions]


def fmt(**fields) -> ResponseFormat:
    return ResponseFormat.model_validate(fields)


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_no_fields_no_plan() -> None:
    plan = plan_output(None, None, None, None, "hermes")
    assert plan.grammar is None and plan.tools == () and plan.tool_format is None


@pytest.mark.parametrize(("response_format", "schema"), [
    ({"type": "json_object"}, {"type": "object"}),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "array"}}}, {"type": "array"}),
])
def test_response_format_becomes_a_json_schema_grammar(response_format: dict, schema: dict) -> None:
    plan = plan_output(fmt(**response_format), None, None, None, "hermes")
    assert plan.grammar.kind == "json_schema" and json.loads(plan.grammar.source) == schema


def test_text_response_format_is_unconstrained() -> None:
    assert plan_output(fmt(type="text"), None, None, None, "hermes").grammar is None


def test_json_schema_type_needs_its_object() -> None:
    with pytest.raises(BadRequest) as error:
        plan_output(fmt(type="json_schema"), None, None, None, "hermes")
    assert error.value.param == "response_format.json_schema"


def test_auto_shows_tools_and_parses_without_constraint() -> None:
    plan = plan_output(None, tools(WEATHER), None, None, "hermes")
    assert plan.grammar is None and plan.tool_format == "hermes"
    assert plan.tools[0]["function"]["name"] == "get_weather"


def test_none_hides_tools_and_parses_nothing() -> None:
    plan = plan_output(None, tools(WEATHER), "none", None, "hermes")
    assert plan.tools == () and plan.tool_format is None


@pytest.mark.parametrize(("choice", "names"), [("required", {"get_weather", "get_time"}),
                                               (named("get_time"), {"get_time"})])
def test_forced_choices_build_a_call_grammar_over_the_right_functions(choice, names) -> None:
    plan = plan_output(None, tools(WEATHER, TIME), choice, None, "hermes")
    assert plan.grammar.kind == "lark" and plan.grammar.param == "tool_choice"
    assert {n for n in ("get_weather", "get_time") if n in plan.grammar.source} == names


def test_parallel_tool_calls_false_allows_one_call() -> None:
    one = plan_output(None, tools(WEATHER), "required", False, "hermes").grammar.source
    many = plan_output(None, tools(WEATHER), "required", True, "hermes").grammar.source
    assert one != many


def test_a_named_function_is_called_exactly_once_and_forced_output_is_calls_only() -> None:
    """OpenAI: tool_choice "required" is one or more calls, a named function exactly one."""
    one = plan_output(None, tools(WEATHER), "required", False, "hermes").grammar.source
    for parallel in (None, True, False):
        plan = plan_output(None, tools(WEATHER), named("get_weather"), parallel, "hermes")
        assert plan.grammar.source == one and plan.calls_only
    assert plan_output(None, tools(WEATHER), "required", None, "hermes").calls_only
    assert not plan_output(None, tools(WEATHER), "auto", None, "hermes").calls_only


@pytest.mark.parametrize(("args", "param"), [
    ((None, None, "required", None), "tool_choice"),
    ((None, tools(WEATHER), named("nope"), None), "tool_choice.function.name"),
    ((fmt(type="json_object"), tools(WEATHER), "required", None), "response_format"),
    ((None, tools(WEATHER, WEATHER), None, None), "tools[1].function.name"),
    ((None, tools({"type": "function", "function": {"name": "bad name!"}}), None, None), "tools[0].function.name"),
    ((None, tools({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}), None, None),
     "tools[0].function.parameters"),
])
def test_inconsistent_fields_are_400s_naming_the_field(args, param: str) -> None:
    with pytest.raises(BadRequest) as error:
        plan_output(*args, "hermes")
    assert error.value.param == param


def test_a_special_marker_token_is_asked_for_by_id_and_kept() -> None:
    plan = plan_output(None, tools(WEATHER), "required", None, "mistral", marker_id=5)
    assert "<[5]>" in plan.grammar.source and plan.marker_id == 5
