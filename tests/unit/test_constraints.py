"""Constraint languages (vLLM's structured_outputs and guided_*, llama.cpp's grammar / json_schema, TGI's
parameters.grammar) -> the GrammarSpec the engine enforces, the Lark text it compiles, and the 400s naming the
field."""

from __future__ import annotations

import json

import llguidance
import pytest

from handler.engine.core.grammars import to_lark
from handler.engine.types import GrammarSpec
from handler.errors import BadRequest
from handler.protocol.chat import ChatCompletionRequest
from handler.protocol.common import parse_model
from handler.protocol.completions import CompletionRequest
from handler.protocol.legacy import LegacyRequest
from handler.protocol.structured import ResponseFormat, plan_output

MESSAGES = [{"role": "user", "content": "hi"}]
GBNF = 'root ::= answer\nanswer ::= "yes" | "no"'


def chat(**fields) -> ChatCompletionRequest:
    return parse_model(ChatCompletionRequest, {"messages": MESSAGES, **fields})


def completion(**fields) -> CompletionRequest:
    return parse_model(CompletionRequest, {"prompt": "hi", **fields})


@pytest.mark.parametrize(("fields", "kind", "source", "param"), [
    ({"structured_outputs": {"regex": r"\d+"}}, "regex", r"\d+", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", '["a", "b"]', "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": GBNF}}, "grammar", GBNF, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "array"}}}, "json_schema", '{"type": "array"}',
     "structured_outputs.json"),
    ({"structured_outputs": {"json": '{"type": "array"}'}}, "json_schema", '{"type": "array"}',
     "structured_outputs.json"),
    ({"structured_outputs": {"json_object": True}}, "json_schema", '{"type": "object"}',
     "structured_outputs.json_object"),
    ({"guided_regex": "a+"}, "regex", "a+", "guided_regex"),
    ({"guided_choice": ["x"]}, "choice", '["x"]', "guided_choice"),
    ({"guided_grammar": 'start: "a"'}, "grammar", 'start: "a"', "guided_grammar"),
    ({"guided_json": {"type": "string"}}, "json_schema", '{"type": "string"}', "guided_json"),
    ({"grammar": GBNF}, "grammar", GBNF, "grammar"),
    ({"json_schema": {"type": "string"}}, "json_schema", '{"type": "string"}', "json_schema"),
])
@pytest.mark.parametrize("build", [chat, completion])
def test_each_field_becomes_its_spec(build, fields: dict, kind: str, source: str, param: str) -> None:
    assert build(**fields).constraint() == GrammarSpec(kind, source, param)


def test_no_constraint_field_no_spec() -> None:
    assert chat().constraint() is None and completion().constraint() is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "grammar": GBNF}, "grammar"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "  "}, "guided_regex"),
])
def test_conflicting_or_malformed_constraints_are_400_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        completion(**fields).constraint()
    assert caught.value.param == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_choice": [1]}, "guided_choice[0]"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
])
def test_malformed_fields_are_400_at_parse(fields: dict, param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        chat(**fields)
    assert caught.value.param == param


def test_response_format_and_a_constraint_together_are_400_naming_the_constraint() -> None:
    request = chat(response_format={"type": "json_object"}, guided_regex="a")
    with pytest.raises(BadRequest) as caught:
        plan_output(request.response_format, None, None, None, "hermes", constraint=request.constraint())
    assert caught.value.param == "guided_regex"


def test_a_constraint_with_a_forced_tool_call_is_400_naming_the_constraint() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    request = chat(tools=[tool], tool_choice="required", guided_choice=["a"])
    with pytest.raises(BadRequest) as caught:
        plan_output(None, request.tools, request.tool_choice, None, "hermes", constraint=request.constraint())
    assert caught.value.param == "guided_choice"


def test_a_constraint_is_the_chat_plan_grammar() -> None:
    plan = plan_output(ResponseFormat(type="text"), None, None, None, "hermes",
                       constraint=GrammarSpec("regex", "a", "guided_regex"))
    assert plan.grammar == GrammarSpec("regex", "a", "guided_regex")


@pytest.mark.parametrize(("grammar", "spec"), [
    ({"type": "json", "value": {"type": "integer"}}, GrammarSpec("json_schema", '{"type": "integer"}',
                                                                 "parameters.grammar.value")),
    ({"type": "json", "value": '{"type": "integer"}'}, GrammarSpec("json_schema", '{"type": "integer"}',
                                                                   "parameters.grammar.value")),
    ({"type": "regex", "value": "[ab]+"}, GrammarSpec("regex", "[ab]+", "parameters.grammar.value")),
    # TGI 3.x's json_schema type (router GrammarType::JsonSchema, value {name?, strict?, schema}) and json's alias
    ({"type": "json_schema", "value": {"name": "n", "strict": True, "schema": {"type": "integer"}}},
     GrammarSpec("json_schema", '{"type": "integer"}', "parameters.grammar.value.schema")),
    ({"type": "json_schema", "value": {"schema": {"type": "integer"}}},
     GrammarSpec("json_schema", '{"type": "integer"}', "parameters.grammar.value.schema")),
    ({"type": "json_object", "value": {"type": "integer"}}, GrammarSpec("json_schema", '{"type": "integer"}',
                                                                        "parameters.grammar.value")),
])
def test_tgi_grammar_becomes_its_spec(grammar: dict, spec: GrammarSpec) -> None:
    request = parse_model(LegacyRequest, {"inputs": "hi", "parameters": {"grammar": grammar}})
    assert request.to_generation_requests([[1, 2]], 8)[0].grammar == spec


@pytest.mark.parametrize(("grammar", "param"), [
    ({"type": "regex", "value": {"a": 1}}, "parameters.grammar.value"),
    ({"type": "json", "value": "nope"}, "parameters.grammar.value"),
    ({"type": "xml", "value": "a"}, "parameters.grammar.type"),
    ({"type": "json_schema", "value": {"type": "integer"}}, "parameters.grammar.value.schema"),  # unwrapped
    ({"type": "json_schema", "value": {"name": "n"}}, "parameters.grammar.value.schema"),
    ({"type": "json_schema", "value": {"schema": "{}"}}, "parameters.grammar.value.schema"),
    ({"type": "json_schema", "value": '{"schema": {}}'}, "parameters.grammar.value"),
])
def test_bad_tgi_grammar_is_400_naming_the_field(grammar: dict, param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        request = parse_model(LegacyRequest, {"inputs": "hi", "parameters": {"grammar": grammar}}, "")
        request.to_generation_requests([[1, 2]], 8)
    assert caught.value.param == param


def test_completions_carry_the_constraint_to_every_prompt() -> None:
    request = completion(prompt=["a", "b"], guided_choice=["yes", "no"])
    generations = request.to_generation_requests([[1], [2]], 0.0)
    assert {g.grammar for g in generations} == {GrammarSpec("choice", '["yes", "no"]', "guided_choice")}


def test_beam_search_with_a_constraint_is_400_naming_it() -> None:
    with pytest.raises(BadRequest) as caught:
        completion(use_beam_search=True, n=1, best_of=2, guided_regex="a").to_generation_requests([[1]], 0.0)
    assert caught.value.param == "guided_regex"


# ---- every language as Lark ------------------------------------------------------------------------------------


def compiles(lark: str) -> bool:
    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark), None) == ""


@pytest.mark.parametrize(("spec", "lark"), [
    (GrammarSpec("regex", r"\d{3}-\d{4}", "p"), r"start: /\d{3}-\d{4}/"),
    (GrammarSpec("regex", "a/b", "p"), r"start: /a\/b/"),
    (GrammarSpec("choice", json.dumps(["red", 'say "hi"', "é"]), "p"), 'start: "red" | "say \\"hi\\"" | "é"'),
    (GrammarSpec("grammar", 'start: "a" "b"', "p"), 'start: "a" "b"'),
    (GrammarSpec("lark", 'start: "a"', "p"), 'start: "a"'),
])
def test_each_language_becomes_lark_that_compiles(spec: GrammarSpec, lark: str) -> None:
    assert to_lark(spec) == lark and compiles(lark)


def test_gbnf_goes_through_llguidances_converter() -> None:
    lark = to_lark(GrammarSpec("grammar", GBNF, "p"))
    assert lark.startswith("%llguidance {}") and "start:" in lark and compiles(lark)


def test_a_json_schema_keeps_the_servers_layout_and_rules() -> None:
    lark = to_lark(GrammarSpec("json_schema", '{"type": "integer"}', "p"))
    schema = json.loads(lark.removeprefix("start: %json "))
    assert schema["maximum"] == 2**53 - 1 and schema["x-guidance"]["whitespace_flexible"] is False
    assert compiles(lark)


@pytest.mark.parametrize("spec", [GrammarSpec("grammar", "root ::= (", "p"), GrammarSpec("regex", "(", "p")])
def test_unreadable_sources_raise_value_error_or_fail_to_compile(spec: GrammarSpec) -> None:
    try:
        lark = to_lark(spec)
    except ValueError:
        return
    assert not compiles(lark)
