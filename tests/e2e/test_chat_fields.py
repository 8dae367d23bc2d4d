"""Each chat-completions field through the real server, in a test that fails if the server ignored the field
(issue #5). The openai SDK is the client wherever it can say the request (``extra_body`` for the vLLM / LMI
extensions); ``requests`` where the raw bytes matter. Greedy unless a test samples; token limits stay small."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import openai
import pytest
import requests
from openai.types.chat import ChatCompletion

from tests.e2e.conftest import sse_events

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]  # greedy: "The capital of France is Paris."
SHORT = 6  # tokens of the capital answer that reach "Paris" and stop before its end, so finish_reason is length
ANSWER_TOKENS = 8  # the whole greedy capital answer, its EOS included
REPEAT = [{"role": "user", "content": "Repeat after me: la la la la la la la la la la la la"}]  # a repetitive answer
HOT = 1.5  # a temperature at which this model's samples differ from its greedy answer at once
TOKENIZER = Path(__file__).resolve().parents[2] / "model_store" / "smollm2-135m-instruct" / "tokenizer.json"


def ask(client: openai.OpenAI, messages: list[dict] = CAPITAL, max_tokens: int = SHORT, model: str = "m",
        **fields) -> ChatCompletion:
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **fields)


def text_of(completion: ChatCompletion) -> str:
    return completion.choices[0].message.content


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI) -> ChatCompletion:
    """The baseline most tests compare with: the capital answer's first SHORT tokens, greedy, with logprobs."""
    completion = ask(client, logprobs=True, top_logprobs=3)
    assert text_of(completion) == "The capital of France is Paris" and completion.choices[0].finish_reason == "length"
    return completion


@pytest.fixture(scope="module")
def hot(client: openai.OpenAI) -> str:
    """The same request at temperature HOT, seeded: what the truncation tests must bring back to greedy."""
    return text_of(ask(client, temperature=HOT, seed=1))


def raw_stream(url: str, **fields) -> list[dict]:
    body = {"messages": CAPITAL, "max_tokens": 4, "stream": True, **fields}
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    return sse_events(response)


# ---- model, token limits -----------------------------------------------------------------------------------------


def test_model_is_echoed_in_the_completion_and_every_chunk(url: str, client: openai.OpenAI) -> None:
    assert ask(client, model="my-model", max_tokens=2).model == "my-model"
    chunks = list(client.chat.completions.create(model="other-name", messages=CAPITAL, max_tokens=2, stream=True))
    assert chunks and all(chunk.model == "other-name" for chunk in chunks)
    unnamed = requests.post(f"{url}/v1/chat/completions", json={"messages": CAPITAL, "max_tokens": 2}, timeout=120)
    assert unnamed.json()["model"] == "smollm2-135m-instruct"  # absent: the served model's name


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_token_limit_ends_the_answer_early(client: openai.OpenAI, field: str) -> None:
    # The whole answer is ANSWER_TOKENS long, so a limit of 3 that were ignored would end with "stop" at 8.
    completion = client.chat.completions.create(model="m", messages=CAPITAL, **{field: 3})
    assert completion.usage.completion_tokens == 3 and completion.choices[0].finish_reason == "length"
    assert text_of(completion) == "The capital of"


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    completion = ask(client, max_tokens=5, max_completion_tokens=2)
    assert completion.usage.completion_tokens == 2


def test_without_a_token_limit_the_answer_runs_to_eos(url: str, client: openai.OpenAI) -> None:
    absent = client.chat.completions.create(model="m", messages=CAPITAL)
    assert text_of(absent) == "The capital of France is Paris."
    assert absent.choices[0].finish_reason == "stop" and absent.usage.completion_tokens == ANSWER_TOKENS
    null = requests.post(f"{url}/v1/chat/completions", json={"messages": CAPITAL, "max_tokens": None}, timeout=120)
    assert null.status_code == 200
    choice = null.json()["choices"][0]
    assert choice["message"]["content"] == text_of(absent) and choice["finish_reason"] == "stop"


def test_ignore_eos_runs_past_the_end_of_the_answer(client: openai.OpenAI) -> None:
    plain = ask(client, max_tokens=ANSWER_TOKENS + 4)
    assert plain.usage.completion_tokens == ANSWER_TOKENS and plain.choices[0].finish_reason == "stop"
    ignoring = ask(client, max_tokens=ANSWER_TOKENS + 4, extra_body={"ignore_eos": True})
    assert ignoring.usage.completion_tokens == ANSWER_TOKENS + 4 and ignoring.choices[0].finish_reason == "length"


# ---- sampling ----------------------------------------------------------------------------------------------------


def test_temperature_zero_is_greedy_whatever_the_seed(client: openai.OpenAI, greedy: ChatCompletion) -> None:
    assert text_of(ask(client, temperature=0, seed=1)) == text_of(ask(client, temperature=0, seed=2)) == text_of(greedy)


def test_high_temperature_samples_away_from_greedy(client: openai.OpenAI, greedy: ChatCompletion, hot: str) -> None:
    samples = {hot} | {text_of(ask(client, temperature=HOT, seed=seed)) for seed in (2, 3)}
    assert len(samples) > 1 and text_of(greedy) not in samples


@pytest.mark.parametrize("fields", [
    {"top_p": 1e-6},
    {"extra_body": {"top_k": 1}},
    {"extra_body": {"min_p": 1.0}},
], ids=["top_p", "top_k", "min_p"])
def test_truncation_to_the_top_token_is_greedy(client: openai.OpenAI, greedy: ChatCompletion, hot: str,
                                               fields: dict) -> None:
    assert hot != text_of(greedy)  # without the truncation field the same request samples something else
    assert text_of(ask(client, temperature=HOT, seed=1, **fields)) == text_of(greedy)


def test_n_returns_indexed_choices_that_differ(client: openai.OpenAI) -> None:
    completion = ask(client, n=3, temperature=1.0, seed=7)
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert len({choice.message.content for choice in completion.choices}) > 1
    assert completion.usage.completion_tokens <= 3 * SHORT


def test_seed_repeats_a_sample_and_another_seed_changes_it(client: openai.OpenAI) -> None:
    first, again, *others = (text_of(ask(client, temperature=1.0, seed=seed)) for seed in (11, 11, 12, 13))
    assert first == again
    assert any(other != first for other in others)


def test_stop_string_ends_the_answer_before_it(client: openai.OpenAI, greedy: ChatCompletion) -> None:
    assert "Paris" in text_of(greedy)
    for stop in ("Paris", ["nowhere", "Paris"]):
        completion = ask(client, max_tokens=SHORT + 4, stop=stop)
        assert text_of(completion) == "The capital of France is " and completion.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="m", messages=CAPITAL, max_tokens=SHORT + 4, stop="Paris",
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The capital of France is "
    assert chunks[-1].choices[0].finish_reason == "stop"


def steps(completion: ChatCompletion) -> list[tuple[str, dict[str, float]]]:
    """Per generated token: the token, and the logprobs of the top alternatives it was chosen from."""
    return [(e.token, {t.token: t.logprob for t in e.top_logprobs}) for e in completion.choices[0].logprobs.content]


def prompt_tokens(messages: list[dict]) -> set[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER.parent)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return {tokenizer.decode([i]) for i in tokenizer.encode(ids, add_special_tokens=False)}


def compared_steps(client: openai.OpenAI, **penalty):
    """The steps of the greedy REPEAT answer with and without the penalty, while both have written the same tokens
    (so both distributions come from the same history): ``(history, plain top, penalised top)``. The answer repeats
    itself, so penalised tokens turn up among the alternatives; what is checked does not hinge on which tokens a
    CPU's rounding makes the greedy ones."""
    plain = steps(ask(client, REPEAT, max_tokens=12, logprobs=True, top_logprobs=20))
    penalised = steps(ask(client, REPEAT, max_tokens=12, logprobs=True, top_logprobs=20, **penalty))
    history: list[str] = []
    for (token, plain_top), (other, penalised_top) in zip(plain, penalised, strict=False):  # shorter ends it
        yield list(history), plain_top, penalised_top
        if token != other:
            return
        history.append(token)


@pytest.mark.parametrize("field", ["frequency_penalty", "presence_penalty"])
def test_penalty_lowers_generated_tokens_by_the_documented_amount(client: openai.OpenAI, field: str) -> None:
    """OpenAI's definition: a token's logit drops by frequency_penalty * (times it was generated) and by
    presence_penalty once it was generated at all; the prompt does not count. The returned logprobs are those of
    the distribution sampled from, so between two alternatives the log-ratio moves by the difference."""
    value = 2.0
    penalty = {"frequency_penalty": lambda n: value * n, "presence_penalty": lambda n: value * (n > 0)}[field]
    moved = 0
    for history, plain_top, penalised_top in compared_steps(client, **{field: value}):
        common = sorted(plain_top.keys() & penalised_top.keys())
        for a, b in itertools.combinations(common, 2):
            expected = penalty(history.count(a)) - penalty(history.count(b))
            observed = (plain_top[a] - plain_top[b]) - (penalised_top[a] - penalised_top[b])
            assert abs(observed - expected) < 1e-3, (history, a, b, observed, expected)
            moved += expected != 0
    assert moved, "no penalised token was among the alternatives: the test checked nothing"


def test_repetition_penalty_lowers_every_seen_token(client: openai.OpenAI) -> None:
    """HF / vLLM's definition: a token seen in the prompt or the output has its logit divided by the penalty when
    positive, multiplied when negative; unseen tokens keep theirs. So against an unseen alternative a seen token
    always loses ground, and two unseen ones keep their ratio."""
    prompt = prompt_tokens(REPEAT)
    lowered = 0
    for history, plain_top, penalised_top in compared_steps(client, extra_body={"repetition_penalty": 1.5}):
        seen = prompt | set(history)
        common = plain_top.keys() & penalised_top.keys()
        unseen = sorted(common - seen)
        for b in unseen:
            for a in sorted(common):
                shift = (plain_top[a] - plain_top[b]) - (penalised_top[a] - penalised_top[b])
                if a in seen:
                    assert shift > 1e-3, (history, a, b, shift)
                    lowered += 1
                else:
                    assert abs(shift) < 1e-3, (history, a, b, shift)
    assert lowered, "no seen token was among the alternatives: the test checked nothing"


def test_logit_bias_bans_the_greedy_first_token(client: openai.OpenAI, greedy: ChatCompletion) -> None:
    from tokenizers import Tokenizer

    first = greedy.choices[0].logprobs.content[0].token
    [token_id] = Tokenizer.from_file(str(TOKENIZER)).encode(first, add_special_tokens=False).ids
    biased = ask(client, logprobs=True, logit_bias={str(token_id): -100})
    tokens = [entry.token for entry in biased.choices[0].logprobs.content]
    assert tokens[0] != first and first not in tokens  # banned at every step, not only the first


# ---- logprobs ----------------------------------------------------------------------------------------------------


def test_logprobs_have_one_entry_per_token_with_top_alternatives(greedy: ChatCompletion) -> None:
    choice = greedy.choices[0]
    content = choice.logprobs.content
    assert len(content) == greedy.usage.completion_tokens == SHORT
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes) == entry.token.encode("utf-8")
        assert len(entry.top_logprobs) == 3
        assert all(top.logprob <= 0 for top in entry.top_logprobs)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        best = entry.top_logprobs[0]  # greedy: the chosen token is the most likely one
        assert best.token == entry.token and best.logprob == pytest.approx(entry.logprob)


def test_logprobs_arrive_in_stream_chunks(client: openai.OpenAI, greedy: ChatCompletion) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=CAPITAL, max_tokens=SHORT, logprobs=True,
                                                 top_logprobs=3, stream=True))
    entries = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    expected = greedy.choices[0].logprobs.content
    assert [e.token for e in entries] == [e.token for e in expected]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in expected])
    assert all(len(e.top_logprobs) == 3 for e in entries)


def test_no_logprobs_unless_asked(client: openai.OpenAI) -> None:
    assert ask(client, max_tokens=2).choices[0].logprobs is None


@pytest.mark.parametrize("fields", [{"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21}],
                         ids=["without-logprobs", "over-20"])
def test_bad_top_logprobs_is_400_naming_it(client: openai.OpenAI, fields: dict) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, max_tokens=2, **fields)
    assert caught.value.body["param"] == "top_logprobs"


# ---- user, streaming usage ---------------------------------------------------------------------------------------


def test_user_is_accepted(client: openai.OpenAI, greedy: ChatCompletion) -> None:
    # The server refuses fields it does not declare, so a 200 means `user` is known (it only labels the caller).
    assert text_of(ask(client, user="user-1234")) == text_of(greedy)


def test_include_usage_adds_one_final_usage_chunk(url: str) -> None:
    events = raw_stream(url, stream_options={"include_usage": True})
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 4
    assert all(chunk["choices"] and "usage" in chunk and chunk["usage"] is None for chunk in chunks)


def test_include_usage_through_the_sdk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=CAPITAL, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert [c for c in chunks if c.usage is not None] == chunks[-1:]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_no_usage_chunk_without_include_usage(url: str) -> None:
    events = raw_stream(url)
    assert all(event["choices"] and event.get("usage") is None for event in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_options_without_stream_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, max_tokens=2, stream_options={"include_usage": True})
    assert caught.value.body["param"] == "stream_options"


# ---- out-of-range values -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "fields"), [
    ("temperature", {"temperature": 3}),
    ("top_p", {"top_p": 0}),
    ("n", {"n": 0}),
    ("frequency_penalty", {"frequency_penalty": 3}),
    ("presence_penalty", {"presence_penalty": -3}),
    ("logit_bias", {"logit_bias": {"1": 200}}),
    ("logit_bias", {"logit_bias": {"49152": 1}}),  # one past the vocabulary
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_completion_tokens", {"max_completion_tokens": 0}),
    ("top_k", {"extra_body": {"top_k": -2}}),
    ("min_p", {"extra_body": {"min_p": 1.5}}),
    ("repetition_penalty", {"extra_body": {"repetition_penalty": 0}}),
], ids=lambda value: value if isinstance(value, str) else json.dumps(value))
def test_out_of_range_value_is_400_naming_the_field(client: openai.OpenAI, field: str, fields: dict) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=CAPITAL, **{"max_tokens": 2, **fields})
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == field and caught.value.body["type"] == "invalid_request_error"
