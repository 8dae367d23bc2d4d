"""Prompt logprobs and token prompts through the real server: lm-evaluation-harness's ``local-completions``
loglikelihood request, sent exactly as it sends it and parsed exactly as it parses the answer, gives transformers'
numbers; echo with logprobs (OpenAI's legacy shape), ``max_tokens: 0``, vLLM's ``prompt_logprobs``, TGI's
``decoder_input_details``, and token-id prompts."""

from __future__ import annotations

from collections.abc import Iterator
from operator import itemgetter

import openai
import pytest
import torch

from handler.config import DEFAULT_MODEL_DIR
from tests.e2e.conftest import post, sse_events, start_server, stop_server
from tests.e2e.test_completions import greedy_token_ids
from tests.integration.test_prompt_logprobs import reference_logprobs

CONTEXT = "The capital of France is"  # the model goes on (a question's answer may start with its EOS)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module", name="fp32_url")
def _fp32_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server on fp32 (``option.quantize=none``) for the tests that hold our numbers to transformers' own fp32
    forward, which lm-evaluation-harness compares models by: the default int8 rows are 0.01-0.2 away from it
    (``bench.quality``'s KL), and the prompt-logprob code they run is the same. (Named with an underscore so that the
    vLLM contract run, which imports this module's tests, uses its own server: tests/vllm/conftest.py.)"""
    running = start_server(tmp_path_factory.mktemp("fp32"), {"OPTION_QUANTIZE": "none"})
    yield running.url
    stop_server(running)


def encode(tokenizer, text: str) -> list[int]:
    """lm-evaluation-harness's tok_encode: the HF tokenizer, no special tokens added."""
    return tokenizer(text, add_special_tokens=False).input_ids


def lm_eval_payload(prompts: list[list[int]]) -> dict:
    """``LocalCompletionsAPI._create_payload(..., generate=False)``: what it sends for loglikelihood tasks."""
    return {"model": "m", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def lm_eval_parse(outputs: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """``LocalCompletionsAPI.parse_logprobs``, as it reads the answer."""
    res = []
    for choice, ctxlen in zip(sorted(outputs["choices"], key=itemgetter("index")), ctxlens, strict=True):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs, strict=True):
            if tok != max(top.values()):
                is_greedy = False
                break
        res.append((logprobs, is_greedy))
    return res


def test_lm_eval_loglikelihood_request_gets_transformers_numbers(fp32_url: str, tokenizer) -> None:
    url, context = fp32_url, encode(tokenizer, CONTEXT)
    greedy = greedy_token_ids(url, CONTEXT, 3)  # the model's own answer, and one it would not give
    assert len(greedy) == 3
    inputs = [context + greedy, context + encode(tokenizer, " a small green banana")]  # lm-eval's batch of pairs
    response = post(url, lm_eval_payload(inputs), path="/v1/completions")
    assert response.status_code == 200, response.text
    parsed = lm_eval_parse(response.json(), [len(context)] * len(inputs))
    for (loglikelihood, is_greedy), prompt_ids in zip(parsed, inputs, strict=True):
        reference = reference_logprobs(DEFAULT_MODEL_DIR, prompt_ids)  # row p scores token p + 1
        scored = reference[torch.arange(len(context) - 1, len(prompt_ids) - 1), torch.tensor(prompt_ids[len(context):])]
        assert loglikelihood == pytest.approx(scored.sum().item(), abs=5e-3)
        assert is_greedy == (reference[len(context) - 1:].argmax(dim=-1).tolist() == prompt_ids[len(context):])
    assert [is_greedy for _, is_greedy in parsed] == [True, False]


def test_echo_with_logprobs_legacy_shape(fp32_url: str, tokenizer) -> None:
    client = openai.OpenAI(base_url=f"{fp32_url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="m", prompt=CONTEXT, max_tokens=2, echo=True, logprobs=2)
    choice, prompt_ids = completion.choices[0], encode(tokenizer, CONTEXT)
    logprobs = choice.logprobs
    num_prompt = len(prompt_ids)
    assert len(logprobs.tokens) == num_prompt + completion.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens[:num_prompt]) == CONTEXT and choice.text.startswith(CONTEXT)
    assert logprobs.text_offset[num_prompt] == len(CONTEXT)  # the completion's tokens start after the prompt
    for token, logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:],
                                   strict=True):
        assert logprob <= 0 and top[token] == logprob and 2 <= len(top) <= 3
    reference = reference_logprobs(DEFAULT_MODEL_DIR, prompt_ids)
    expected = reference[torch.arange(num_prompt - 1), torch.tensor(prompt_ids[1:])].tolist()
    assert logprobs.token_logprobs[1:num_prompt] == pytest.approx(expected, abs=2e-3)


def test_echo_with_max_tokens_0_is_the_prompt_alone(client: openai.OpenAI, tokenizer) -> None:
    completion = client.completions.create(model="m", prompt=CONTEXT, max_tokens=0, echo=True, logprobs=0)
    choice = completion.choices[0]
    assert choice.text == CONTEXT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(encode(tokenizer, CONTEXT))
    assert completion.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as caught:  # without echo there is nothing to return
        client.completions.create(model="m", prompt=CONTEXT, max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"


def test_streamed_echo_with_logprobs_sends_the_prompts_first(url: str, tokenizer) -> None:
    body = {"prompt": CONTEXT, "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True}
    chunks = sse_events(post(url, body, path="/v1/completions"))
    first = chunks[0]["choices"][0]
    assert first["text"] == CONTEXT and first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(encode(tokenizer, CONTEXT))
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [len(CONTEXT)]


def test_vllm_prompt_logprobs(client: openai.OpenAI, tokenizer) -> None:
    prompt_ids = encode(tokenizer, CONTEXT)
    completion = client.completions.create(model="m", prompt=CONTEXT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    scored = completion.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(prompt_ids) and scored[0] is None
    for token_id, entry in zip(prompt_ids[1:], scored[1:], strict=True):
        mine = entry[str(token_id)]
        assert mine["logprob"] <= 0 and mine["rank"] >= 1 and mine["decoded_token"]
        assert {1, 2} <= {e["rank"] for e in entry.values()} and len(entry) in (2, 3)  # its own, and the top 2


def test_token_prompts_answer_like_text(client: openai.OpenAI, tokenizer) -> None:
    ids = encode(tokenizer, CONTEXT)
    by_text = client.completions.create(model="m", prompt=CONTEXT, max_tokens=4)
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=4, echo=True)
    assert by_ids.choices[0].text == CONTEXT + by_text.choices[0].text  # echo decodes the ids
    batch = client.completions.create(model="m", prompt=[ids, ids[:5]], max_tokens=4)
    assert batch.choices[0].text == by_text.choices[0].text and len(batch.choices) == 2
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="m", prompt=[ids, [1, 10**6]], max_tokens=1)
    assert caught.value.body["param"] == "prompt[1]" and "vocabulary" in caught.value.body["message"]


def test_legacy_decoder_input_details_prefill(fp32_url: str, tokenizer) -> None:
    url, prompt_ids = fp32_url, encode(tokenizer, CONTEXT)
    body = {"inputs": CONTEXT, "parameters": {"max_new_tokens": 2, "decoder_input_details": True}}
    response = post(url, body)
    assert response.status_code == 200, response.text
    details = response.json()[0]["details"] if isinstance(response.json(), list) else response.json()["details"]
    prefill = details["prefill"]
    assert [p["id"] for p in prefill] == prompt_ids and prefill[0]["logprob"] is None
    assert "".join(p["text"] for p in prefill) == CONTEXT and len(details["tokens"]) == details["generated_tokens"]
    reference = reference_logprobs(DEFAULT_MODEL_DIR, prompt_ids)
    expected = reference[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])].tolist()
    assert [p["logprob"] for p in prefill[1:]] == pytest.approx(expected, abs=2e-3)
    streamed = post(url, {**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["param"] == "parameters.decoder_input_details"
