"""Both schemas, both framings and every route through the real server, with requests and the openai SDK."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from tests.e2e.conftest import post, sse_events

CAPITAL = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
# Prompts whose greedy answers contain multi-byte characters split across byte-level tokens.
MULTIBYTE_PROMPTS = ["How do you say thank you in Japanese?", "Translate 'good morning' to Chinese.",
                     "Écris une phrase en français sur Paris."]


def json_lines(response: requests.Response) -> list[dict]:
    raw = response.content.decode("utf-8")
    assert raw.endswith("\n")
    return [json.loads(line) for line in raw.split("\n")[:-1]]


def test_ping_is_200_with_empty_body(url):
    response = requests.get(f"{url}/ping", timeout=2)
    assert response.status_code == 200
    assert response.content == b""


def test_chat_on_invocations_answers_paris(url):
    response = post(url, CAPITAL)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and response.headers["X-Request-Id"] == body["id"]
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and choice["index"] == 0 and choice["logprobs"] is None
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > usage["prompt_tokens"] > 0
    assert body["model"] and body["system_fingerprint"] and isinstance(body["created"], int)


def test_messages_wins_over_inputs(url):
    response = post(url, {**CAPITAL, "inputs": "ignored", "max_tokens": 4})
    assert response.json()["object"] == "chat.completion"


def test_openai_sdk_chat_and_stream_agree(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    completion = client.chat.completions.create(model="m", messages=CAPITAL["messages"], max_tokens=24)
    text = completion.choices[0].message.content
    assert "Paris" in text and completion.model == "m"
    stream = client.chat.completions.create(model="m", messages=CAPITAL["messages"], max_tokens=24, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == completion.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_openai_sdk_bad_request_names_the_field(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=CAPITAL["messages"], temperature=3.5)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "temperature"


@pytest.mark.parametrize("prompt", MULTIBYTE_PROMPTS)
def test_streamed_text_equals_non_streamed_text_byte_for_byte(url, prompt):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40}
    whole = post(url, body).json()["choices"][0]["message"]["content"]
    lines = json_lines(post(url, {**body, "stream": True}))
    streamed = "".join(line["choices"][0]["delta"].get("content", "") for line in lines if line["choices"])
    assert streamed == whole
    assert "\ufffd" not in streamed


def test_some_multibyte_output_really_is_multibyte(url):
    texts = [post(url, {"messages": [{"role": "user", "content": p}], "max_tokens": 40}).json()
             ["choices"][0]["message"]["content"] for p in MULTIBYTE_PROMPTS]
    assert any(ord(ch) > 0x7FF for text in texts for ch in text)  # 3-byte UTF-8 characters at least


def test_chat_stream_on_invocations_is_json_lines_by_default(url):
    response = post(url, {**CAPITAL, "stream": True, "max_tokens": 8})
    assert response.headers["Content-Type"].startswith("application/jsonlines")
    lines = json_lines(response)
    assert all(line["object"] == "chat.completion.chunk" for line in lines)
    assert lines[0]["choices"][0]["delta"]["role"] == "assistant"
    assert lines[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_stream_on_invocations_is_sse_when_asked(url):
    response = post(url, {**CAPITAL, "stream": True, "max_tokens": 8}, headers={"Accept": "text/event-stream"})
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_completions_route_streams_sse(url):
    response = post(url, {**CAPITAL, "stream": True, "max_tokens": 8}, path="/v1/chat/completions")
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert len(sse_events(response)) >= 2


def test_legacy_string_input(url):
    response = post(url, {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}})
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"generated_text"} and "Paris" in body["generated_text"]


def test_legacy_list_input_and_details(url):
    body = {"inputs": ["The capital of France is", "One, two, three,"],
            "parameters": {"max_new_tokens": 6, "details": True}}
    results = post(url, body).json()
    assert isinstance(results, list) and len(results) == 2
    for result in results:
        details = result["details"]
        assert details["finish_reason"] in ("length", "eos_token", "stop_sequence")
        assert details["generated_tokens"] == len(details["tokens"]) == 6
        token = details["tokens"][0]
        assert set(token) == {"id", "text", "log_prob", "special"} and token["log_prob"] <= 0


def test_legacy_return_full_text(url):
    prompt = "The capital of France is"
    body = post(url, {"inputs": prompt, "parameters": {"max_new_tokens": 4, "return_full_text": True}}).json()
    assert body["generated_text"].startswith(prompt) and len(body["generated_text"]) > len(prompt)


def test_legacy_stream_lines_join_to_generated_text(url):
    body = {"inputs": "Translate 'good morning' to Chinese:", "parameters": {"max_new_tokens": 24}}
    whole = post(url, body).json()["generated_text"]
    lines = json_lines(post(url, {**body, "stream": True}))
    assert all(set(line) >= {"token", "generated_text", "details"} for line in lines)
    assert all(line["generated_text"] is None for line in lines[:-1])
    assert lines[-1]["generated_text"] == whole == "".join(line["token"]["text"] for line in lines)


def test_greedy_stop_sequence_is_not_emitted(url):
    body = {"inputs": "One, two, three, four,", "parameters": {"max_new_tokens": 20, "stop": [" six"], "details": True}}
    result = post(url, body).json()
    assert " six" not in result["generated_text"]
    assert result["details"]["finish_reason"] == "stop_sequence"


@pytest.mark.parametrize(("raw", "status"), [
    (b"{not json", 400),
    (b'{"foo": 1}', 400),
    (b"[1, 2]", 400),
    (b'{"inputs": "x", "parameters": {"temperature": NaN}}', 400),
])
def test_bad_bodies_get_clear_4xx(url, raw, status):
    response = requests.post(f"{url}/invocations", data=raw, headers={"Content-Type": "application/json"}, timeout=10)
    assert response.status_code == status
    assert response.json()["error"]


def test_neither_field_names_both(url):
    message = post(url, {"prompt_text": "x"}).json()["error"]["message"]
    assert "messages" in message and "inputs" in message


def test_chat_bad_field_uses_openai_error_shape(url):
    response = post(url, {**CAPITAL, "top_p": 0})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "top_p"


def test_legacy_bad_field_uses_legacy_error_shape(url):
    response = post(url, {"inputs": "x", "parameters": {"max_new_tokens": 0}})
    assert response.status_code == 400
    body = response.json()
    assert body["param"] == "parameters.max_new_tokens" and body["code"] == 400 and isinstance(body["error"], str)


def test_unknown_chat_field_is_refused_not_ignored(url):
    response = post(url, {**CAPITAL, "frobnicate": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "frobnicate"


def test_oversized_body_is_413_and_worker_keeps_serving(url):
    huge = b'{"inputs": "' + b"a" * (6 * 1024 * 1024 + 10) + b'"}'
    response = requests.post(f"{url}/invocations", data=huge, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 413 and response.json()["error"]
    assert requests.get(f"{url}/ping", timeout=2).status_code == 200
    assert post(url, {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_prompt_longer_than_context_is_400_naming_lengths(url):
    response = post(url, {"inputs": "word " * 9000, "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 400
    assert "tokens" in response.json()["error"]


def test_unknown_route_is_json_404(url):
    response = requests.get(f"{url}/nope", timeout=5)
    assert response.status_code == 404 and response.json()["error"]

