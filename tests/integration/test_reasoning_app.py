"""Reasoning through the real server code (Flask app, chat formatter) with a scripted engine that emits a thinking
model's transcript token by token (tiny checkpoints cannot think): the split, chunk by chunk when streamed, the
length cut inside the reasoning, usage, and the unchanged openai SDK reading ``reasoning`` from ``model_extra``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from handler import server
from handler.config import DEFAULT_MODEL_DIR, Settings
from handler.engine.types import FinishReason, GenerationRequest, TokenEvent
from handler.prompt.renderer import PromptRenderer
from handler.service import RequestDefaults
from tests.integration.conftest import post
from tests.integration.test_server_app import MODEL_NAME, FakeEngine, FakeService

CHAT = {"messages": [{"role": "user", "content": "Capital of France?"}]}
TRANSCRIPT = "<think>\nThe user asks about France.\n</think>\n\nParis."


@pytest.fixture(scope="module")
def renderer() -> PromptRenderer:
    if not (DEFAULT_MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("the embedded model is not assembled (make model)")
    from handler.engine.core.tokenizer import load_tokenizer

    return PromptRenderer(load_tokenizer(Path(DEFAULT_MODEL_DIR)), reasoning_parser="qwen3")


def transcript_script(renderer: PromptRenderer, text: str, finish: FinishReason = FinishReason.EOS):
    """Each token of ``text`` as its own event, then the finish (EOS, or LENGTH on the last token)."""
    ids = renderer.encode(text)

    def script(request: GenerationRequest) -> list:
        events = [TokenEvent(0, t, renderer.tokenizer.decode([t])) for t in ids]
        if finish is FinishReason.LENGTH:
            last = events.pop()
            events.append(TokenEvent(0, last.token_id, last.text, finish_reason=finish,
                                     num_prompt_tokens=len(request.prompt_ids), num_generated_tokens=len(ids)))
        else:
            events.append(TokenEvent(0, 2, "", is_special=True, finish_reason=finish,
                                     num_prompt_tokens=len(request.prompt_ids), num_generated_tokens=len(ids) + 1))
        return events
    return script


def app_client(renderer: PromptRenderer, script):
    service = FakeService(settings=Settings(), model_name=MODEL_NAME, defaults=RequestDefaults(0.0, 256),
                          renderer=renderer, engine=FakeEngine(script), user_handler=None)
    return server.create_app(service)


def num_tokens(renderer: PromptRenderer, text: str) -> int:
    return len(renderer.encode(text))


def test_the_answer_is_split_into_reasoning_and_content(renderer: PromptRenderer) -> None:
    app = app_client(renderer, transcript_script(renderer, TRANSCRIPT))
    body = post(app.test_client(), "/v1/chat/completions", CHAT).get_json()
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.", "reasoning": "\nThe user asks about France.\n",
                       "reasoning_content": "\nThe user asks about France.\n"}
    assert body["choices"][0]["finish_reason"] == "stop"
    # the tokens from after <think> up to and including </think>'s last token
    thinking = num_tokens(renderer, "<think>\nThe user asks about France.\n</think>") - num_tokens(renderer, "<think>")
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking}


def test_streamed_deltas_carry_reasoning_then_content_chunk_by_chunk(renderer: PromptRenderer) -> None:
    app = app_client(renderer, transcript_script(renderer, TRANSCRIPT))
    response = post(app.test_client(), "/v1/chat/completions",
                    {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    frames = [json.loads(f.removeprefix("data: ")) for f in response.get_data(as_text=True).split("\n\n")[:-2]]
    deltas = [f["choices"][0]["delta"] for f in frames if f["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    kinds = [next(iter(d)) for d in deltas[1:] if d]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # every reasoning delta before any content
    assert all(d["reasoning"] == d["reasoning_content"] for d in deltas if "reasoning" in d)
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nThe user asks about France.\n"
    assert "".join(d.get("content", "") for d in deltas) == "Paris."
    assert not any("<think>" in json.dumps(d) or "</think>" in json.dumps(d) for d in deltas)
    assert frames[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_a_cut_inside_the_reasoning_is_length_with_null_content(renderer: PromptRenderer) -> None:
    app = app_client(renderer, transcript_script(renderer, "<think>\nStill thinking about", FinishReason.LENGTH))
    body = post(app.test_client(), "/v1/chat/completions", {**CHAT, "max_tokens": 5}).get_json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["reasoning"] == "\nStill thinking about"


def test_the_legacy_schema_returns_the_raw_text(renderer: PromptRenderer) -> None:
    app = app_client(renderer, transcript_script(renderer, TRANSCRIPT))
    body = post(app.test_client(), "/invocations", {"inputs": "Capital of France?"}).get_json()
    assert body["generated_text"] == TRANSCRIPT


def test_chat_template_kwargs_cannot_override_the_servers_arguments(renderer: PromptRenderer) -> None:
    app = app_client(renderer, transcript_script(renderer, TRANSCRIPT))
    response = post(app.test_client(), "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": True}})
    assert response.status_code == 400 and response.get_json()["error"]["param"] == "chat_template_kwargs.tokenize"


def test_the_openai_sdk_reads_reasoning_from_model_extra(renderer: PromptRenderer) -> None:
    app = app_client(renderer, transcript_script(renderer, TRANSCRIPT))
    http = httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://app")
    client = openai.OpenAI(base_url="http://app/v1", api_key="unused", http_client=http, max_retries=0)
    completion = client.chat.completions.create(model="m", messages=CHAT["messages"],
                                                extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = completion.choices[0].message
    assert message.content == "Paris." and message.model_extra["reasoning"] == "\nThe user asks about France.\n"
    stream = client.chat.completions.create(model="m", messages=CHAT["messages"], stream=True)
    chunks = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in chunks) == message.model_extra["reasoning"]
    assert "".join(d.content or "" for d in chunks) == "Paris."


def test_the_responses_api_returns_the_reasoning_as_a_reasoning_item(renderer: PromptRenderer) -> None:
    """The openai SDK's responses.create and its stream: the reasoning item first, the answer as output_text."""
    app = app_client(renderer, transcript_script(renderer, TRANSCRIPT))
    http = httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://app")
    client = openai.OpenAI(base_url="http://app/v1", api_key="unused", http_client=http, max_retries=0)
    response = client.responses.create(model="m", input="Capital of France?", reasoning={"effort": "low"})
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "\nThe user asks about France.\n"
    assert response.output_text == "Paris." and response.reasoning.effort == "low"
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model="m", input="Capital of France?", stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == response.output[0].content[0].text
    assert events[-1].response.output_text == "Paris."
