"""Beam search through the real server (issue #26): vLLM's ``use_beam_search``, the OVMS reference's ``best_of``
with sampling off, HF / legacy ``num_beams``, ``length_penalty`` and ``early_stopping``; equal to transformers'
``generate(num_beams=...)`` on an fp32 server, and refused in one line where it cannot apply."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.e2e.conftest import post
from tests.e2e.test_chat_fields import CAPITAL, TOKENIZER
from tests.e2e.test_prompt_logprobs import _fp32_server  # noqa: F401 (the fp32 server fixture, fp32_url)

HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def reference():
    """transformers' beam search on the embedded model, fp32, with the chat template's prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = TOKENIZER.parent
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def beams(messages: list[dict], width: int, n: int, max_new_tokens: int, **options) -> list[str]:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(prompt, num_beams=width, num_return_sequences=n, do_sample=False,
                                 max_new_tokens=max_new_tokens, **options)
        return tokenizer.batch_decode(out[:, prompt.shape[1]:], skip_special_tokens=True)

    return beams


def chat(url: str, **fields) -> dict:
    response = post(url, {"messages": HAIKU, "max_tokens": 20, **fields}, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    return response.json()


def texts(body: dict) -> list[str]:
    return [choice["message"]["content"] for choice in body["choices"]]


@pytest.mark.parametrize("options", [{}, {"length_penalty": 0.0, "early_stopping": True},
                                     {"length_penalty": 2.0, "early_stopping": "never"}])
def test_use_beam_search_equals_transformers(fp32_url: str, reference, options: dict) -> None:
    body = chat(fp32_url, use_beam_search=True, n=2, best_of=4, **options)
    assert texts(body) == reference(HAIKU, 4, 2, 20, **options)
    assert [c["index"] for c in body["choices"]] == [0, 1] and len(set(texts(body))) == 2
    assert body["usage"]["completion_tokens"] > 0


def test_best_of_with_sampling_off_is_the_beam_width(fp32_url: str, reference) -> None:
    """The OVMS reference's rule: greedy best_of candidates would be one answer best_of times."""
    assert texts(chat(fp32_url, best_of=3, n=2, temperature=0)) == reference(HAIKU, 3, 2, 20)
    assert texts(chat(fp32_url, best_of=3, n=2, temperature=0)) != texts(chat(fp32_url, n=2, temperature=0))


def test_completions_and_legacy_take_beams_too(fp32_url: str, reference) -> None:
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(TOKENIZER.parent).apply_chat_template(HAIKU, add_generation_prompt=True,
                                                                                 tokenize=False)
    expected = reference(HAIKU, 3, 1, 20)
    completion = post(fp32_url, {"prompt": prompt, "max_tokens": 20, "use_beam_search": True, "best_of": 3},
                      "/v1/completions").json()
    assert completion["choices"][0]["text"] == expected[0]
    legacy = post(fp32_url, {"inputs": prompt, "parameters": {"max_new_tokens": 20, "num_beams": 3,
                                                               "details": True}}).json()
    assert legacy["generated_text"] == expected[0] and legacy["details"]["generated_tokens"] > 0


def test_the_default_server_serves_beams_through_the_sdk(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="m", messages=CAPITAL, max_tokens=12, n=2,
                                                extra_body={"use_beam_search": True, "best_of": 3})
    answers = [c.message.content for c in completion.choices]
    assert len(answers) == 2 and len(set(answers)) == 2 and all("Paris" in a for a in answers)


def test_diversity_penalty_makes_the_beams_start_differently(url: str) -> None:
    """Diverse beam search, a group a beam: a large penalty sends each group to a first token no earlier group
    took; without it beams share their first tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER.parent)

    def first_tokens(body: dict) -> set[int]:
        return {tokenizer.encode(text, add_special_tokens=False)[0] for text in texts(body)}

    plain = chat(url, use_beam_search=True, n=3, best_of=3, messages=CAPITAL, max_tokens=6)
    diverse = chat(url, use_beam_search=True, n=3, best_of=3, messages=CAPITAL, max_tokens=6, diversity_penalty=50.0)
    assert len(first_tokens(diverse)) == 3 > len(first_tokens(plain))


@pytest.mark.parametrize(("body", "param"), [
    ({"use_beam_search": True, "stream": True}, "stream"),
    ({"use_beam_search": True, "temperature": 0.8}, "temperature"),
    ({"use_beam_search": True, "stop": ["."]}, "stop"),
    ({"use_beam_search": True, "logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
    ({"use_beam_search": True, "response_format": {"type": "json_object"}}, "response_format"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"diversity_penalty": 1.0}, "diversity_penalty"),
    ({"early_stopping": True, "temperature": 0.5}, "early_stopping"),
    ({"use_beam_search": True, "best_of": 64}, "use_beam_search"),
])
def test_what_beam_search_cannot_take_is_refused_naming_the_field(url: str, body: dict, param: str) -> None:
    response = requests.post(f"{url}/v1/chat/completions", json={"messages": CAPITAL, "max_tokens": 8, **body},
                             timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_legacy_refusals(url: str) -> None:
    for parameters, param in [({"num_beams": 2, "do_sample": True}, "parameters.do_sample"),
                              ({"num_beams": 2, "stop": ["."]}, "parameters.stop"),
                              ({"early_stopping": True}, "parameters.early_stopping")]:
        response = post(url, {"inputs": "Hello", "parameters": {"max_new_tokens": 4, **parameters}})
        assert response.status_code == 400 and response.json()["param"] == param, response.text
    streamed = post(url, {"inputs": "Hello", "stream": True, "parameters": {"num_beams": 2}})
    assert streamed.status_code == 400 and streamed.json()["param"] == "stream"
