"""A thinking model's answer split through the real server (``python -m handler serve``: gunicorn, the lean engine,
int8 as shipped), read by the unchanged openai SDK. The model is ``tests/support/thinking_model.py``'s chain llama:
greedy decoding writes ``<think>The user asks about France.</think>Paris!`` with Qwen3's real chat template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.conftest import RunningServer, start_server, stop_server
from tests.support.thinking_model import QUESTION, TRANSCRIPT, build_thinking_llama, raw_completion


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Settings as shipped, except ``option.model_id``: the built model, not the embedded one."""
    folder = build_thinking_llama(tmp_path_factory.mktemp("thinking") / "model")
    running = start_server(tmp_path_factory.mktemp("thinking-server"), env={"OPTION_MODEL_ID": str(folder)})
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def sdk(thinking_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="unused", max_retries=0)


def test_the_completions_route_returns_the_raw_transcript(thinking_server: RunningServer) -> None:
    """The model writes the transcript (checked raw, unsplit, where no split applies)."""
    choice = raw_completion(thinking_server.url, timeout=120)
    assert choice["text"] == TRANSCRIPT and choice["finish_reason"] == "stop"


def test_the_sdk_reads_reasoning_and_content(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=20, temperature=0)
    message = completion.choices[0].message
    assert message.content == "Paris!"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == \
           "The user asks about France."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens_details.reasoning_tokens == 7  # 6 thinking tokens and </think>


def test_the_sdk_streams_reasoning_deltas_then_content_deltas(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.model_extra["reasoning"] for d in deltas if (d.model_extra or {}).get("reasoning")]
    content = [d.content for d in deltas if d.content]
    assert reasoning == ["The", " user", " asks", " about", " France", "."]  # one delta per token
    assert content == ["Paris", "!"]
    kinds = ["r" if (d.model_extra or {}).get("reasoning") else "c" for d in deltas if d.content or d.model_extra]
    assert kinds == sorted(kinds, key=lambda k: k != "r")  # every reasoning delta before any content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 7
    assert not any("think>" in json.dumps(d.model_dump()) for d in deltas)

