"""Constrained decoding in the real engine: grammars are applied per row inside the shared batch."""

from __future__ import annotations

import json

import jsonschema
import pytest

from handler.engine.types import FinishReason, GenerationRequest, GrammarSpec, SamplingParams, StopConditions
from handler.errors import BadRequest
from tests.integration.test_engine_small import chat_ids, collect

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def constrained(name: str, prompt_ids, spec: GrammarSpec | None, **sampling) -> GenerationRequest:
    return GenerationRequest(name, prompt_ids, sampling=SamplingParams(**sampling),
                             stop=StopConditions(max_new_tokens=60), grammar=spec)


def test_json_schema_output_validates_and_ends_with_the_grammar(engine, renderer) -> None:
    spec = GrammarSpec("json_schema", json.dumps(PERSON), "response_format")
    prompt = chat_ids(renderer, "Describe Ada Lovelace as JSON.")
    choice = collect(engine.submit(constrained("g", prompt, spec)))[0]
    jsonschema.validate(json.loads(choice.text), PERSON)
    assert choice.finish.finish_reason is FinishReason.EOS


def test_constrained_and_free_rows_share_a_batch(engine, renderer) -> None:
    """A free request batched beside constrained ones gives the same tokens as alone; sampled constrained rows
    (seeded) validate too."""
    prompt = chat_ids(renderer, "What is the capital of France?")
    alone = collect(engine.submit(constrained("free", prompt, None)))[0]
    spec = GrammarSpec("json_schema", json.dumps(PERSON), "response_format")
    handles = [engine.submit(constrained("free2", prompt, None))] + [
        engine.submit(constrained(f"c{i}", prompt, spec, temperature=1.0, seed=i)) for i in range(3)]
    results = [collect(h)[0] for h in handles]
    assert results[0].token_ids == alone.token_ids
    for choice in results[1:]:
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_lark_grammar_restricts_to_its_language(engine, renderer) -> None:
    spec = GrammarSpec("lark", 'start: "yes" | "no"', "tool_choice")
    prompt = chat_ids(renderer, "Is Paris in France?")
    choice = collect(engine.submit(constrained("y", prompt, spec)))[0]
    assert choice.text in ("yes", "no")


def test_a_bad_schema_is_refused_at_submit(engine, renderer) -> None:
    spec = GrammarSpec("json_schema", json.dumps({"type": "no-such-type"}), "response_format.json_schema.schema")
    with pytest.raises(BadRequest) as error:
        engine.submit(constrained("bad", chat_ids(renderer, "hi"), spec))
    assert error.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize(("keep", "expected"), [((1,), "<|im_start|>yes"), ((), "yes")])
def test_a_kept_special_token_stays_in_the_text(engine, renderer, keep, expected) -> None:
    """A tool-call marker that is a special token (Mistral's [TOOL_CALLS]) must reach the parser: the grammar asks
    for the token by id and ``keep_special_ids`` keeps its text, which detokenising would drop."""
    request = GenerationRequest("marker", chat_ids(renderer, "Answer yes."), stop=StopConditions(max_new_tokens=8),
                                grammar=GrammarSpec("lark", 'start: <[1]> "yes"', "tool_choice"), keep_special_ids=keep)
    assert collect(engine.submit(request))[0].text == expected


@pytest.mark.parametrize(("spec", "pattern"), [
    (GrammarSpec("regex", r"\d{3}-\d{4}", "guided_regex"), r"[0-9]{3}-[0-9]{4}"),
    (GrammarSpec("choice", '["red", "green", "blue"]', "guided_choice"), "red|green|blue"),
    (GrammarSpec("grammar", 'root ::= "A" digit digit\ndigit ::= [0-9]', "grammar"), "A[0-9]{2}"),
    (GrammarSpec("grammar", 'start: "B" DIGIT DIGIT\nDIGIT: /[0-9]/', "guided_grammar"), "B[0-9]{2}"),
])
def test_regex_choice_and_grammars_restrict_to_their_language(engine, renderer, spec: GrammarSpec,
                                                              pattern: str) -> None:
    import re

    choice = collect(engine.submit(constrained("r", chat_ids(renderer, "What is the capital of France?"), spec)))[0]
    assert re.fullmatch(pattern, choice.text), choice.text


@pytest.mark.parametrize("spec", [GrammarSpec("grammar", "root ::= (", "structured_outputs.grammar"),
                                  GrammarSpec("regex", "(", "guided_regex"),
                                  GrammarSpec("grammar", "start: undefined_rule", "grammar")])
def test_a_grammar_that_does_not_compile_is_refused_naming_its_field(engine, renderer, spec: GrammarSpec) -> None:
    with pytest.raises(BadRequest) as error:
        engine.submit(constrained("bad", chat_ids(renderer, "hi"), spec))
    assert error.value.param == spec.param


def test_a_gated_grammar_leaves_the_reasoning_free(engine, renderer) -> None:
    """With the reasoning open (a thinking model's prompt), the model writes free text until ``</think>``: this
    model never closes it, so its prose runs to max_tokens where the same regex ungated would have held."""
    import re

    from handler.engine.types import ReasoningGate

    gate = ReasoningGate("<think>", "</think>", opened=True)
    spec = GrammarSpec("regex", r"\d{3}-\d{4}", "guided_regex", gate)
    request = GenerationRequest("gated", chat_ids(renderer, "What is the capital of France?"),
                                stop=StopConditions(max_new_tokens=8), grammar=spec)
    choice = collect(engine.submit(request))[0]
    assert choice.finish.finish_reason is FinishReason.LENGTH and not re.fullmatch(r"[0-9-]*", choice.text)
