"""Speculative decoding through the real server (issue #27). It is off by default, so these servers set
option.speculative_draft_model (prompt lookup; the embedded model drafting for itself) and are compared with the
session's default server: the same greedy and seeded texts, streamed or not, with the drafts counted in /metrics;
the OVMS reference's request fields honoured, and refused where the server has no draft."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from handler.config import DEFAULT_MODEL_DIR
from tests.e2e.conftest import post, start_server, stop_server
from tests.e2e.test_metrics import scrape, value

SOURCE = ("The container serves a language model on SageMaker. It speaks the OpenAI chat-completions schema and the "
          "classic inputs and parameters schema. Its own engine batches requests continuously on the CPU, in int8.")
COPY = [{"role": "user", "content": f"Repeat this text word for word:\n\n{SOURCE}"}]
QUESTION = [{"role": "user", "content": "Describe Paris in two sentences."}]


@pytest.fixture(scope="module", params=["ngram", "draft"])
def drafting(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(url, "ngram" | "draft") of a server that drafts."""
    draft = "ngram" if request.param == "ngram" else str(DEFAULT_MODEL_DIR)
    running = start_server(tmp_path_factory.mktemp(request.param),
                           {"OPTION_SPECULATIVE_DRAFT_MODEL": draft, "OPTION_SPECULATIVE_LENGTH": "4"})
    yield running.url, request.param
    stop_server(running)


def text(url: str, messages: list[dict], **fields) -> str:
    response = post(url, {"messages": messages, "max_tokens": 48, **fields}, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def streamed(url: str, messages: list[dict], **fields) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chunks = client.chat.completions.create(model="m", messages=messages, max_tokens=48, stream=True, **fields)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_answers_are_the_default_servers(drafting: tuple[str, str], url: str) -> None:
    drafting_url = drafting[0]
    before = scrape(drafting_url)
    for messages in (COPY, QUESTION):
        assert text(drafting_url, messages, temperature=0) == text(url, messages, temperature=0)
        assert streamed(drafting_url, messages, temperature=0) == text(url, messages, temperature=0)
        seeded = {"temperature": 0.8, "seed": 5}
        assert text(drafting_url, messages, **seeded) == text(url, messages, **seeded)
    assert text(drafting_url, COPY, temperature=0, num_assistant_tokens=2) == text(url, COPY, temperature=0)
    after = scrape(drafting_url)
    drafted = value(after, "llm_spec_decode_draft_tokens_total") - value(before, "llm_spec_decode_draft_tokens_total")
    accepted = (value(after, "llm_spec_decode_accepted_tokens_total")
                - value(before, "llm_spec_decode_accepted_tokens_total"))
    assert drafted > 0 and 0 < accepted <= drafted


def test_the_request_fields_need_the_servers_drafting(drafting: tuple[str, str], url: str) -> None:
    drafting_url, kind = drafting
    refused = post(url, {"messages": COPY, "num_assistant_tokens": 3}, "/v1/chat/completions")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "num_assistant_tokens"
    both = post(drafting_url, {"messages": COPY, "num_assistant_tokens": 3, "assistant_confidence_threshold": 0.5},
                "/v1/chat/completions")
    assert both.status_code == 400 and both.json()["error"]["param"] == "assistant_confidence_threshold"
    confident = post(drafting_url, {"messages": COPY, "max_tokens": 16, "temperature": 0,
                                    "assistant_confidence_threshold": 0.5}, "/v1/chat/completions")
    if kind == "ngram":
        assert confident.status_code == 400 and "draft model" in confident.json()["error"]["message"]
    else:
        assert confident.json()["choices"][0]["message"]["content"] == text(url, COPY, temperature=0,
                                                                            max_tokens=16)
