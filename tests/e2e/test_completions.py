"""/v1/completions, /v1/models, best_of and the extra-parameters header through the real server (openai SDK where it
can say the request, else requests). Greedy unless a test samples, so outputs repeat; token limits stay small."""

from __future__ import annotations

import math

import openai
import pytest

from tests.e2e.conftest import post

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


def greedy_token_ids(url: str, prompt: str, num_tokens: int) -> list[int]:
    """The greedy continuation's token ids (the legacy schema's details name them; its prompt is raw like ours)."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": num_tokens, "details": True}}
    return [t["id"] for t in post(url, body).json()["details"]["tokens"]]


# ---- completions -----------------------------------------------------------------------------------------------


def test_completion_echo_and_suffix(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="my-model", prompt=PROMPT, max_tokens=4)
    assert plain.object == "text_completion" and plain.model == "my-model" and plain.id.startswith("cmpl-")
    text = plain.choices[0].text
    assert text and plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 4
    echoed = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, echo=True)
    assert echoed.choices[0].text == PROMPT + text
    suffixed = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, suffix=" [END]")
    assert suffixed.choices[0].text == text + " [END]"


def test_completion_logprobs_legacy_shape(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, logprobs=2)
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens == 4
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob <= 0 and top[token] == logprob and 2 <= len(top) <= 3
        assert logprob >= max(top.values()) - 1e-6  # greedy: the chosen token is the most likely


def test_several_prompts_are_prompt_major(client: openai.OpenAI) -> None:
    other = "One, two, three,"
    batch = client.completions.create(model="m", prompt=[PROMPT, other], n=2, max_tokens=3)
    first, second = (client.completions.create(model="m", prompt=p, max_tokens=3) for p in (PROMPT, other))
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [first.choices[0].text] * 2 + [second.choices[0].text] * 2  # greedy
    assert first.choices[0].text != second.choices[0].text
    assert batch.usage.completion_tokens == 12
    assert batch.usage.prompt_tokens == first.usage.prompt_tokens + second.usage.prompt_tokens


def test_stream_joins_to_the_completion_and_ends_with_usage(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, suffix="!")
    chunks = list(
        client.completions.create(
            model="m", prompt=PROMPT, max_tokens=6, suffix="!", stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_prompt_on_invocations_is_a_completion(url: str) -> None:
    response = post(url, {"prompt": PROMPT, "max_tokens": 3})
    assert response.status_code == 200 and response.json()["object"] == "text_completion"
    lines = post(url, {"prompt": [PROMPT, PROMPT], "max_tokens": 3, "stream": True})
    assert lines.status_code == 400 and lines.json()["error"]["param"] == "prompt"


def test_use_raw_prompt_false_answers_like_chat(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=12)
    templated = client.completions.create(
        model="m", prompt=QUESTION, max_tokens=12, extra_body={"use_raw_prompt": False}
    )
    raw = client.completions.create(model="m", prompt=QUESTION, max_tokens=12)
    assert templated.choices[0].text == chat.choices[0].message.content
    assert templated.usage.prompt_tokens == chat.usage.prompt_tokens > raw.usage.prompt_tokens


def test_logit_bias_against_the_greedy_first_token(url: str, client: openai.OpenAI) -> None:
    first = greedy_token_ids(url, PROMPT, 1)[0]
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, logprobs=0)
    biased = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=2, logprobs=0, logit_bias={str(first): -100}
    )
    assert biased.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]


# ---- best_of ---------------------------------------------------------------------------------------------------


def test_completion_best_of_returns_the_most_likely_candidate(client: openai.OpenAI) -> None:
    sampled = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 1234}
    candidates = client.completions.create(n=3, logprobs=0, **sampled)
    scores = [sum(c.logprobs.token_logprobs) for c in candidates.choices]
    best = client.completions.create(n=1, best_of=3, **sampled)
    assert len({c.text for c in candidates.choices}) > 1  # the candidates differ, so the choice means something
    assert best.choices[0].text == candidates.choices[scores.index(max(scores))].text
    assert best.choices[0].index == 0 and len(best.choices) == 1
    assert best.usage.completion_tokens == candidates.usage.completion_tokens == 12


def test_chat_best_of_returns_the_most_likely_candidate(client: openai.OpenAI) -> None:
    sampled = {
        "model": "m",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 4,
        "temperature": 1.0,
        "seed": 99,
    }
    candidates = client.chat.completions.create(n=3, logprobs=True, **sampled)
    scores = [math.fsum(t.logprob for t in c.logprobs.content) for c in candidates.choices]
    best = client.chat.completions.create(n=1, extra_body={"best_of": 3}, **sampled)
    assert best.choices[0].message.content == candidates.choices[scores.index(max(scores))].message.content
    assert best.usage.completion_tokens == candidates.usage.completion_tokens


def test_best_of_below_n_or_streamed_is_400(client: openai.OpenAI) -> None:
    for extra in ({"n": 2, "best_of": 1}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="m", prompt=PROMPT, max_tokens=2, **extra)
        assert caught.value.body["param"] == "best_of"


# ---- /v1/models ------------------------------------------------------------------------------------------------


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    [model] = client.models.list().data
    assert model.object == "model" and model.owned_by == "sagemaker-llm-container" and isinstance(model.created, int)
    assert model.id == "smollm2-135m-instruct"
    assert client.models.retrieve(model.id).id == model.id
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.status_code == 404 and caught.value.body["code"] == "model_not_found"


# ---- extra-parameters ------------------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Write a long story about a dragon."}]


def test_unknown_field_is_400_by_default(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, extra_body={"max_new_tokens": 3})
    assert caught.value.body["param"] == "max_new_tokens"


def test_ignore_drops_and_names_the_fields(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="m",
        messages=MESSAGES,
        max_tokens=5,
        extra_body={"max_new_tokens": 3, "frobnicate": True},
        extra_headers={"extra-parameters": "ignore"},
    )
    assert raw.headers["extra-parameters-ignored"] == "max_new_tokens,frobnicate"
    assert raw.parse().usage.completion_tokens == 5  # max_new_tokens was dropped, not used


def test_pass_through_hands_engine_parameters_on(client: openai.OpenAI) -> None:
    headers = {"extra-parameters": "pass-through"}
    completion = client.chat.completions.create(
        model="m", messages=MESSAGES, extra_body={"max_new_tokens": 3}, extra_headers=headers
    )
    assert completion.usage.completion_tokens == 3
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.completions.create(
            model="m", prompt=PROMPT, max_tokens=2, extra_body={"logits_processors": []}, extra_headers=headers
        )
    assert caught.value.body["param"] == "logits_processors" and "cannot serve" in caught.value.body["message"]


def test_stop_token_ids_in_legacy_parameters(url: str) -> None:
    second = greedy_token_ids(url, PROMPT, 2)[1]
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "details": True, "stop_token_ids": [second]}}
    details = post(url, body).json()["details"]
    assert details["generated_tokens"] == 2 and details["finish_reason"] == "stop_sequence"


def test_bad_header_value_is_400_naming_it(url: str) -> None:
    response = post(url, {"prompt": PROMPT, "max_tokens": 2}, headers={"extra-parameters": "sometimes"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "extra-parameters"
