"""Constraint languages through the real server: vLLM's ``structured_outputs`` / ``guided_*`` (openai SDK's
``extra_body``), llama.cpp's ``grammar`` and ``json_schema`` on completions, TGI's ``parameters.grammar`` on the
legacy schema. Each test fails if the server ignored the field: unconstrained, this model answers these prompts in
prose (checked once below). Greedy, small token limits."""

from __future__ import annotations

import concurrent.futures
import json
import re

import openai
import pytest

from tests.e2e.conftest import post

PHONE = r"\d{3}-\d{4}"
PHONE_TEXT = re.compile(r"[0-9]{3}-[0-9]{4}")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COLOURS = ["crimson", "teal", "ochre"]
LARK = 'start: "Answer: " ANSWER\nANSWER: "yes" | "no"'
GBNF = 'root ::= "Code " digit digit "!"\ndigit ::= [0-9]'


def ask(client: openai.OpenAI, max_tokens: int = 12, **extra) -> str:
    completion = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=max_tokens,
                                                extra_body=extra)
    return completion.choices[0].message.content


def test_unconstrained_the_model_answers_in_prose(client: openai.OpenAI) -> None:
    text = ask(client)
    assert not PHONE_TEXT.fullmatch(text) and text not in COLOURS and not text.startswith("Answer: ")


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": PHONE}}, {"guided_regex": PHONE}])
def test_a_regex_shapes_the_chat_answer(client: openai.OpenAI, extra: dict) -> None:
    assert PHONE_TEXT.fullmatch(ask(client, **extra))


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": COLOURS}}, {"guided_choice": COLOURS}])
def test_a_choice_is_one_of_its_words(client: openai.OpenAI, extra: dict) -> None:
    assert ask(client, **extra) in COLOURS


@pytest.mark.parametrize(("extra", "pattern"), [
    ({"structured_outputs": {"grammar": LARK}}, r"Answer: (yes|no)"),
    ({"guided_grammar": GBNF}, r"Code [0-9]{2}!"),
])
def test_lark_and_gbnf_grammars_shape_the_chat_answer(client: openai.OpenAI, extra: dict, pattern: str) -> None:
    assert re.fullmatch(pattern, ask(client, **extra))


def test_a_streamed_constrained_answer_equals_the_whole_one(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=12, stream=True,
                                            extra_body={"guided_regex": PHONE})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == ask(client, guided_regex=PHONE)


def test_llama_cpp_grammar_and_json_schema_on_completions(url: str) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    gbnf = post(url, {**body, "grammar": GBNF}, path="/v1/completions").json()
    assert re.fullmatch(r"Code [0-9]{2}!", gbnf["choices"][0]["text"])
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    answer = post(url, {**body, "max_tokens": 20, "json_schema": schema}, path="/v1/completions").json()
    assert set(json.loads(answer["choices"][0]["text"])) == {"city"}


def test_tgi_grammar_in_legacy_parameters(url: str) -> None:
    regex = {"inputs": "My phone number is", "parameters": {"max_new_tokens": 12,
                                                               "grammar": {"type": "regex", "value": PHONE}}}
    assert PHONE_TEXT.fullmatch(post(url, regex).json()["generated_text"])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer = post(url, {"inputs": "Is Paris in France?", "parameters": {
        "max_new_tokens": 12, "grammar": {"type": "json", "value": schema}}}).json()
    assert isinstance(json.loads(answer["generated_text"])["ok"], bool)


def test_tgi_json_schema_grammar_in_legacy_parameters(url: str) -> None:
    """TGI 3.x's ``{"type": "json_schema", "value": {"name", "strict", "schema"}}`` (router ``GrammarType``): free,
    this prompt continues in prose; under the grammar the text is the schema's object, on /invocations and TGI's
    /generate, and through huggingface_hub's InferenceClient, whose ``grammar`` argument sends that shape."""
    from huggingface_hub import InferenceClient

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    grammar = {"type": "json_schema", "value": {"name": "answer", "strict": True, "schema": schema}}
    free = post(url, {"inputs": "Is Paris in France?", "parameters": {"max_new_tokens": 12}}).json()
    with pytest.raises(ValueError):
        json.loads(free["generated_text"])
    for path in ("/invocations", "/generate"):
        answer = post(url, {"inputs": "Is Paris in France?", "parameters": {"max_new_tokens": 12, "grammar": grammar}},
                      path=path).json()
        assert set(json.loads(answer["generated_text"])) == {"ok"}
    text = InferenceClient(base_url=f"{url}/generate").text_generation("Is Paris in France?", max_new_tokens=12,
                                                                       grammar=grammar)
    assert isinstance(json.loads(text)["ok"], bool)
    bad = post(url, {"inputs": "hi", "parameters": {"grammar": {"type": "json_schema", "value": {"name": "n"}}}})
    assert bad.status_code == 400 and "parameters.grammar.value.schema" in bad.text


def test_constrained_and_free_requests_batch_together(client: openai.OpenAI) -> None:
    """Concurrent requests share the engine's batch: each keeps its own constraint, the free one its prose."""
    alone = ask(client)
    asks = [{}, {"guided_regex": PHONE}, {"guided_choice": COLOURS}, {"guided_grammar": GBNF}]
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        free, phone, colour, code = pool.map(lambda extra: ask(client, **extra), asks)
    assert free == alone and PHONE_TEXT.fullmatch(phone) and colour in COLOURS
    assert re.fullmatch(r"Code [0-9]{2}!", code)


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_a_grammar_that_does_not_compile_is_400_naming_the_field(client: openai.OpenAI, extra: dict,
                                                                  param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, **extra)
    assert caught.value.body["param"] == param
    assert ask(client, guided_choice=COLOURS) in COLOURS  # and the server keeps serving
