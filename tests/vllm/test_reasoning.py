"""A thinking model on vLLM (``option.rolling_batch=vllm``, issue #29): the reasoning split, and a constraint that
starts where the reasoning ends, read by the unchanged openai SDK.

The model is ``tests/support/thinking_model.py``'s chain llama (greedy decoding writes
``<think>The user asks about France.</think>Paris!``, Qwen3's real chat template), widened to hidden 256 with 4 heads
(head size 64, as test_parallel.py's llama: vLLM's CPU attention has no kernel for heads under 32). Settings are
the shipped ones except ``option.model_id`` (this model, not the embedded one) and, from this folder's conftest,
``option.rolling_batch=vllm`` and ``option.enforce_eager=true`` (start-up without torch.compile; no answer differs).
``option.reasoning_parser`` stays ``auto``: the server reads ``qwen3`` from the template, splits the answer in its
prompt layer, and hands vLLM the same parser (commit 3201d53), whose ``StructuredOutputManager`` then starts the
grammar after ``</think>`` (``_get_constraint_bounds``; ``enable_in_reasoning`` off, as shipped).

Why the constraint tests fail both ways: unconstrained, the chain model answers ``Paris!``, which no constraint
here allows; constrained from the first token, it could not write ``<think>`` (neither JSON nor the choices start
with it), so there would be no reasoning, and never the chain's thinking.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.conftest import RunningServer, start_server, stop_server
from tests.support.thinking_model import ANSWER, QUESTION, THINKING, TRANSCRIPT, build_thinking_llama, raw_completion

CITIES = ["Lyon", "Nice"]  # not the model's own answer (Paris!)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}}, "required": ["city"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = build_thinking_llama(tmp_path_factory.mktemp("thinking") / "model", hidden_size=256,
                                  intermediate_size=512, max_position_embeddings=2048)
    running = start_server(tmp_path_factory.mktemp("thinking-server"), env={"OPTION_MODEL_ID": str(folder)})
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def sdk(thinking_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def reasoning_of(message) -> tuple[str | None, str | None]:
    extra = message.model_extra or {}
    return extra.get("reasoning"), extra.get("reasoning_content")


def test_vllm_walks_the_chain_to_the_raw_transcript(thinking_server: RunningServer) -> None:
    """vLLM's forward writes the transcript (raw on the completions route, where no split applies)."""
    choice = raw_completion(thinking_server.url, timeout=300)
    assert choice["text"] == TRANSCRIPT and choice["finish_reason"] == "stop"


def test_the_sdk_reads_reasoning_and_content(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=20, temperature=0)
    message = completion.choices[0].message
    assert message.content == ANSWER
    assert reasoning_of(message) == (THINKING, THINKING)
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens_details.reasoning_tokens == 7  # 6 thinking tokens and </think>


def test_the_sdk_streams_reasoning_deltas_then_content_deltas(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.model_extra["reasoning"] for d in deltas if (d.model_extra or {}).get("reasoning")]
    assert all(d.model_extra["reasoning"] == d.model_extra["reasoning_content"] for d in deltas
               if (d.model_extra or {}).get("reasoning"))
    content = [d.content for d in deltas if d.content]
    # vLLM's steps may reach the stream coalesced on a busy machine: the pieces add up, in order
    assert "".join(reasoning) == THINKING and len(reasoning) > 1
    assert "".join(content) == ANSWER
    kinds = ["r" if (d.model_extra or {}).get("reasoning") else "c" for d in deltas if d.content or d.model_extra]
    assert kinds == sorted(kinds, key=lambda k: k != "r")  # every reasoning delta before any content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 7
    assert not any("think>" in json.dumps(d.model_dump()) for d in deltas)


def test_a_json_schema_starts_after_the_reasoning(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    message = completion.choices[0].message
    assert reasoning_of(message) == (THINKING, THINKING)  # the chain's own thinking: no grammar before </think>
    assert json.loads(message.content)["city"] in CITIES  # and the grammar after it (unconstrained: Paris!)
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_choice_starts_after_the_reasoning(sdk: openai.OpenAI, stream: bool) -> None:
    asked = {"model": "m", "messages": QUESTION, "max_tokens": 40, "temperature": 0,
             "extra_body": {"structured_outputs": {"choice": CITIES}}}
    if stream:
        deltas = [c.choices[0].delta for c in sdk.chat.completions.create(**asked, stream=True) if c.choices]
        reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = sdk.chat.completions.create(**asked).choices[0].message
        (reasoning, _), content = reasoning_of(message), message.content
    assert reasoning == THINKING
    assert content in CITIES
