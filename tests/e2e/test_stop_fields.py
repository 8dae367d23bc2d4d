"""Where a choice ends and how its tokens become text (vLLM's fields, issue #26), and the tokenizer routes, through
the real server. Each test compares with the same request without the field, so it fails if the field is ignored:
``include_stop_str_in_output``, ``min_tokens`` (legacy ``min_new_tokens``), ``stop_token_ids``,
``skip_special_tokens``, ``spaces_between_special_tokens``; streamed text is held to the non-streamed text.
``/tokenize`` and ``/detokenize`` are held to the tokenizer's own ids, text and chat template."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.e2e.conftest import post, sse_events
from tests.e2e.test_chat_fields import CAPITAL, TOKENIZER

ANSWER = "The capital of France is Paris."  # the greedy answer to CAPITAL, ended by EOS after 7 tokens of text
EOS_TEXT = "<|im_end|>"


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER.parent)


def chat(url: str, **fields) -> dict:
    response = post(url, {"messages": CAPITAL, "max_tokens": 30, **fields}, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    return response.json()


def streamed(url: str, **fields) -> tuple[str, str]:
    """The streamed content joined, and the finish reason."""
    response = requests.post(f"{url}/v1/chat/completions", json={"messages": CAPITAL, "max_tokens": 30,
                                                                 "stream": True, **fields}, timeout=120)
    events = [e for e in sse_events(response) if e.get("choices")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    return text, events[-1]["choices"][0]["finish_reason"]


def content(body: dict) -> tuple[str, str]:
    return body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]


@pytest.fixture(scope="module")
def baseline(url: str) -> dict:
    body = chat(url)
    assert content(body) == (ANSWER, "stop") and body["usage"]["completion_tokens"] == 8
    return body


# ---- include_stop_str_in_output ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_the_stop_string_is_in_the_text_only_when_asked(url: str, baseline: dict, stream: bool) -> None:
    ask = (lambda **f: streamed(url, **f)) if stream else (lambda **f: content(chat(url, **f)))
    assert ask(stop=" Paris") == ("The capital of France is", "stop")
    assert ask(stop=" Paris", include_stop_str_in_output=True) == ("The capital of France is Paris", "stop")
    assert ask(stop=["is Par", "France"], include_stop_str_in_output=True) == ("The capital of France", "stop")


def test_legacy_and_completions_take_it_too(url: str, hf_tokenizer) -> None:
    prompt = hf_tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=False)
    legacy = post(url, {"inputs": prompt, "parameters": {"max_new_tokens": 30, "stop": ["France"],
                                                          "include_stop_str_in_output": True}}).json()
    assert legacy["generated_text"] == "The capital of France"
    completion = post(url, {"prompt": prompt, "max_tokens": 30, "stop": "France", "include_stop_str_in_output": True},
                      "/v1/completions").json()
    assert completion["choices"][0]["text"] == "The capital of France"


# ---- min_tokens ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_eos_back(url: str, baseline: dict, stream: bool) -> None:
    body = chat(url, min_tokens=12)
    text, finish = content(body)
    assert text.startswith(ANSWER) and len(text) > len(ANSWER) and body["usage"]["completion_tokens"] >= 12
    if stream:
        assert streamed(url, min_tokens=12) == (text, finish)


def test_a_stop_string_before_min_tokens_does_not_count(url: str, baseline: dict) -> None:
    assert content(chat(url, stop=".")) == ("The capital of France is Paris", "stop")
    text, _ = content(chat(url, stop=".", min_tokens=8))  # the "." is token 7: text like any other
    assert text.startswith(ANSWER) and "." not in text[len(ANSWER):]


def test_legacy_min_new_tokens(url: str, hf_tokenizer) -> None:
    prompt = hf_tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=False)
    plain = post(url, {"inputs": prompt, "parameters": {"max_new_tokens": 30, "details": True}}).json()
    held = post(url, {"inputs": prompt, "parameters": {"max_new_tokens": 30, "details": True,
                                                        "min_new_tokens": 12}}).json()
    assert plain["generated_text"] == ANSWER and plain["details"]["generated_tokens"] == 8
    assert held["generated_text"].startswith(ANSWER) and held["details"]["generated_tokens"] >= 12


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": CAPITAL, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"messages": CAPITAL, "max_completion_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 4, "min_new_tokens": 5}}, "parameters.min_new_tokens"),
    ({"inputs": "x", "parameters": {"min_new_tokens": 1, "min_tokens": 1}}, "parameters.min_new_tokens"),
])
def test_a_minimum_above_the_maximum_is_refused(url: str, body: dict, param: str) -> None:
    response = post(url, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"] if isinstance(error, dict) else response.json()["param"]) == param


# ---- stop_token_ids, special tokens ----------------------------------------------------------------------------

def test_stop_token_ids_end_the_choice_before_the_token(url: str, baseline: dict, hf_tokenizer) -> None:
    paris = hf_tokenizer.convert_tokens_to_ids("ĠParis")
    assert content(chat(url, stop_token_ids=[paris])) == ("The capital of France is", "stop")
    assert content(chat(url, stop_token_ids=[paris], include_stop_str_in_output=True)) == (
        "The capital of France is Paris", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_text_when_not_skipped(url: str, baseline: dict, stream: bool) -> None:
    ask = (lambda **f: streamed(url, **f)) if stream else (lambda **f: content(chat(url, **f)))
    assert ask(skip_special_tokens=False) == (ANSWER, "stop")  # the EOS that ends it is not text (vLLM's rule)
    assert ask(skip_special_tokens=False, include_stop_str_in_output=True) == (ANSWER + EOS_TEXT, "stop")
    assert ask(skip_special_tokens=False, include_stop_str_in_output=True, spaces_between_special_tokens=True) == (
        ANSWER + " " + EOS_TEXT, "stop")
    assert ask(include_stop_str_in_output=True) == (ANSWER, "stop")  # skipped: EOS has no text


def test_the_openai_sdk_sends_them_as_extra_body(client: openai.OpenAI, baseline: dict) -> None:
    completion = client.chat.completions.create(model="m", messages=CAPITAL, max_tokens=30, stop=" Paris",
                                                extra_body={"include_stop_str_in_output": True, "min_tokens": 2})
    assert completion.choices[0].message.content == "The capital of France is Paris"


# ---- /tokenize, /detokenize ------------------------------------------------------------------------------------

def tokenize(url: str, **body) -> dict:
    response = requests.post(f"{url}/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_a_prompt_as_the_tokenizer_does(url: str, hf_tokenizer) -> None:
    text = "Hello, world! Café 日本 😀"
    answer = tokenize(url, prompt=text, return_token_strs=True)
    ids = hf_tokenizer.encode(text, add_special_tokens=True)
    assert answer == {"count": len(ids), "max_model_len": answer["max_model_len"], "tokens": ids,
                      "token_strs": hf_tokenizer.convert_ids_to_tokens(ids)}
    assert answer["max_model_len"] == 8192
    assert tokenize(url, prompt=text, add_special_tokens=False)["tokens"] == hf_tokenizer.encode(
        text, add_special_tokens=False)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_tokenize_messages_as_the_chat_template_does(url: str, hf_tokenizer, generation_prompt: bool) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *CAPITAL]
    answer = tokenize(url, messages=messages, add_generation_prompt=generation_prompt)
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    assert answer["tokens"] == hf_tokenizer.encode(expected, add_special_tokens=False)
    assert answer["token_strs"] is None and answer["count"] == len(answer["tokens"])


def test_tokenize_counts_what_the_chat_route_sends(url: str) -> None:
    """Tools included: the count is the chat route's prompt_tokens for the same messages."""
    tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    counted = tokenize(url, messages=CAPITAL, tools=tools)["count"]
    usage = post(url, {"messages": CAPITAL, "tools": tools, "max_tokens": 1}, "/v1/chat/completions").json()["usage"]
    assert counted == usage["prompt_tokens"] > tokenize(url, messages=CAPITAL)["count"]


def test_detokenize_is_the_tokenizers_decode(url: str, hf_tokenizer) -> None:
    ids = hf_tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=False)
    ids = hf_tokenizer.encode(ids, add_special_tokens=False)
    response = requests.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30)
    assert response.json() == {"prompt": hf_tokenizer.decode(ids)}


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages[0].content[0]"),
])
def test_tokenizer_routes_refuse_bad_bodies_naming_the_field(url: str, route: str, body: dict, param: str) -> None:
    response = requests.post(f"{url}{route}", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
