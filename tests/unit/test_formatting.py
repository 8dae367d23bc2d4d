"""Formatters: hand-built token events -> exact chat / legacy records, and exact JSON-lines / SSE bytes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from handler.engine.types import FinishReason, PromptLogprob, TokenEvent, TopLogprob
from handler.errors import EngineError, ErrorShape, NotReady, error_record
from handler.formatting import chat, legacy
from handler.formatting.chat import ChatContext
from handler.formatting.context import FormatContext
from handler.formatting.framing import JSONLINES_MIMETYPE, SSE_MIMETYPE, jsonlines, sse
from handler.formatting.legacy import LegacyContext

VOCAB = {2: "<|im_end|>", 5: "Hel", 6: "lo", 7: " wor", 8: "ld", 9: "é"}
EOS = FinishReason.EOS


def token_text(token_id: int) -> str:
    return VOCAB.get(token_id, f"<{token_id}>")


def token_bytes(token_id: int) -> bytes:
    return token_text(token_id).encode("utf-8")


def ctx(kind: type[FormatContext] = ChatContext, **options) -> FormatContext:
    return kind(request_id="chatcmpl-abc", model="tiny", created=1700000000, token_text=token_text,
                         token_bytes=token_bytes, **options)


def ev(index: int, token_id: int | None, text: str, logprob: float | None = None, *, finish: FinishReason | None = None,
       prompt: int = 0, generated: int = 0, special: bool = False, top: tuple = (), error: str | None = None
       ) -> TokenEvent:
    return TokenEvent(index=index, token_id=token_id, text=text, logprob=logprob, top_logprobs=top, is_special=special,
                      finish_reason=finish, error=error, num_prompt_tokens=prompt, num_generated_tokens=generated)


def hello_events(finish: FinishReason = EOS) -> list[TokenEvent]:
    """One choice: 'Hello world', then the end (an EOS token that releases no text)."""
    last = (ev(0, 2, "", -0.01, finish=finish, prompt=4, generated=5, special=True) if finish is EOS
            else ev(0, 8, "ld", -0.5, finish=finish, prompt=4, generated=4))
    body = [ev(0, 5, "Hel", -0.1), ev(0, 6, "lo", -0.2), ev(0, 7, " wor", -0.3)]
    return body + ([ev(0, 8, "ld", -0.4), last] if finish is EOS else [last])


# ---- chat: non-streaming --------------------------------------------------------------------------------------

def test_chat_completion_exact_shape() -> None:
    record = chat.chat_completion(hello_events(), 1, ctx())
    assert record == {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "tiny",
        "system_fingerprint": chat.SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello world"}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
    }


@pytest.mark.parametrize(("finish", "wire"), [
    (FinishReason.EOS, "stop"), (FinishReason.STOP, "stop"), (FinishReason.LENGTH, "length")])
def test_chat_finish_reason_mapping(finish: FinishReason, wire: str) -> None:
    record = chat.chat_completion(hello_events(finish), 1, ctx())
    assert record["choices"][0]["finish_reason"] == wire
    chunks = list(chat.chat_chunks(hello_events(finish), 1, ctx()))
    assert chunks[-1]["choices"][0]["finish_reason"] == wire


def test_chat_completion_n_choices_interleaved_and_usage_sums() -> None:
    events = [
        ev(1, 7, "B", -0.5), ev(0, 5, "A", -0.1),
        ev(2, 9, "é", -0.9, finish=FinishReason.LENGTH, prompt=6, generated=1),
        ev(0, 6, "a", -0.2, finish=FinishReason.STOP, prompt=6, generated=2),
        ev(1, 2, "", -0.3, finish=EOS, prompt=6, generated=2, special=True),
    ]
    record = chat.chat_completion(events, 3, ctx())
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in record["choices"]] == [
        (0, "Aa", "stop"), (1, "B", "stop"), (2, "é", "length")]
    assert record["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}


def test_chat_completion_logprobs_skip_special_tokens() -> None:
    events = [ev(0, 5, "Hel", -0.1, top=(TopLogprob(5, -0.1), TopLogprob(9, -2.5))),
              ev(0, 2, "", -0.05, finish=EOS, prompt=1, generated=2, special=True)]
    record = chat.chat_completion(events, 1, ctx(want_logprobs=True))
    assert record["choices"][0]["logprobs"] == {"content": [{
        "token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108],
        "top_logprobs": [{"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108]},
                         {"token": "é", "logprob": -2.5, "bytes": [0xC3, 0xA9]}]}]}


@pytest.mark.parametrize(("finish", "error_type"), [(FinishReason.ERROR, EngineError), (FinishReason.ABORT, NotReady)])
def test_chat_completion_failed_choice_raises(finish: FinishReason, error_type: type) -> None:
    events = [ev(0, 5, "Hel", -0.1), ev(0, None, "", finish=finish, error="boom")]
    with pytest.raises(error_type):
        chat.chat_completion(events, 1, ctx())


# ---- chat: streaming ------------------------------------------------------------------------------------------

def _base() -> dict:
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1700000000, "model": "tiny",
            "system_fingerprint": chat.SYSTEM_FINGERPRINT}


def _chunk(delta: dict, finish: str | None = None, index: int = 0, **extra) -> dict:
    return {**_base(), "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
            **extra}


def test_chat_chunks_exact() -> None:
    chunks = list(chat.chat_chunks(hello_events(), 1, ctx()))
    assert chunks == [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk({"content": " wor"}),
        _chunk({"content": "ld"}),
        _chunk({}, "stop"),
    ]


def test_chat_chunks_skip_empty_non_final_events() -> None:
    events = [ev(0, 5, "", -0.1), ev(0, 6, "Hello", -0.2), ev(0, 8, "", -0.3, finish=FinishReason.STOP, generated=3)]
    chunks = list(chat.chat_chunks(events, 1, ctx()))
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "Hello"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]


def test_chat_chunks_include_usage() -> None:
    chunks = list(chat.chat_chunks(hello_events(), 1, ctx(include_usage=True)))
    assert all("usage" in c for c in chunks)
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1] == {**_base(), "choices": [],
                          "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}}
    assert sum(1 for c in chunks if c["choices"] == []) == 1
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_chat_chunks_n_choices_role_first_each() -> None:
    events = [ev(1, 7, "B", -0.5), ev(0, 5, "A", -0.1, finish=FinishReason.LENGTH, prompt=3, generated=1),
              ev(1, 8, "b", -0.5, finish=FinishReason.LENGTH, prompt=3, generated=2)]
    chunks = list(chat.chat_chunks(events, 2, ctx(include_usage=True)))
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:2]] == [
        (0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
            for c in chunks[2:-1]] == [(1, {"content": "B"}, None), (0, {"content": "A"}, "length"),
                                       (1, {"content": "b"}, "length")]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chat_chunks_logprobs() -> None:
    events = [ev(0, 5, "Hel", -0.1, top=(TopLogprob(5, -0.1),)),
              ev(0, 2, "", -0.01, finish=EOS, prompt=1, generated=2, special=True)]
    chunks = list(chat.chat_chunks(events, 1, ctx(want_logprobs=True)))
    assert chunks[1]["choices"][0]["logprobs"] == {"content": [{
        "token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108],
        "top_logprobs": [{"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108]}]}]}
    assert chunks[2]["choices"][0]["logprobs"] is None  # the EOS token is special


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_chunks_error_mid_stream_is_the_last_record(include_usage: bool) -> None:
    events = iter([ev(0, 5, "Hel", -0.1), ev(0, None, "", finish=FinishReason.ERROR, error="boom"),
                   ev(0, 6, "lo", -0.2)])
    chunks = list(chat.chat_chunks(events, 1, ctx(include_usage=include_usage)))
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hel"}
    assert len(chunks) == 3
    assert chunks[-1] == {"error": {"message": "generation failed: boom", "type": "internal_error",
                                    "param": None, "code": None}}


def test_chat_chunks_abort_ends_with_error_record() -> None:
    chunks = list(chat.chat_chunks([ev(0, None, "", finish=FinishReason.ABORT)], 1, ctx()))
    assert list(chunks[-1]) == ["error"]
    assert chunks[-1]["error"]["type"] == "internal_error"
    assert "cancelled" in chunks[-1]["error"]["message"]


# ---- legacy ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("finish", "wire"), [
    (FinishReason.EOS, "eos_token"), (FinishReason.STOP, "stop_sequence"), (FinishReason.LENGTH, "length")])
def test_legacy_finish_reason_mapping(finish: FinishReason, wire: str) -> None:
    record = legacy.generated(hello_events(finish), "Say", ctx(LegacyContext, want_logprobs=True))
    assert record["details"]["finish_reason"] == wire
    lines = list(legacy.generated_lines(hello_events(finish), "Say", ctx(LegacyContext, want_logprobs=True)))
    assert lines[-1]["details"]["finish_reason"] == wire


def test_legacy_generated_plain() -> None:
    assert legacy.generated(hello_events(), "Say", ctx(LegacyContext)) == {"generated_text": "Hello world"}


def test_legacy_generated_return_full_text() -> None:
    assert legacy.generated(hello_events(), "Say: ", ctx(LegacyContext, return_full_text=True)) == {
        "generated_text": "Say: Hello world"}


def test_legacy_generated_details_tokens_use_token_text() -> None:
    # the event texts differ from the tokens' own texts (a stop-string hold-back moved text between events)
    events = [ev(0, 5, "", -0.1), ev(0, 6, "Hello", -0.2),
              ev(0, 9, "é", -0.3, finish=FinishReason.LENGTH, prompt=2, generated=3)]
    record = legacy.generated(events, "p", ctx(LegacyContext, want_logprobs=True))
    assert record == {"generated_text": "Helloé", "details": {
        "finish_reason": "length", "generated_tokens": 3, "inputs": "p",
        "tokens": [{"id": 5, "text": "Hel", "log_prob": -0.1, "special": False},
                   {"id": 6, "text": "lo", "log_prob": -0.2, "special": False},
                   {"id": 9, "text": "é", "log_prob": -0.3, "special": False}]}}


def test_legacy_decoder_input_details_prefill_is_tgis_shape() -> None:
    prompt = (PromptLogprob(5, None), PromptLogprob(6, -1.5, 3), PromptLogprob(9, -0.25, 1))
    events = [ev(0, 7, " wor", -0.1), ev(0, 8, "ld", -0.2, finish=FinishReason.LENGTH, prompt=3, generated=2)]
    events[0] = dataclasses.replace(events[0], prompt_logprobs=prompt)
    record = legacy.generated(events, "Helloé", ctx(LegacyContext, want_logprobs=True, want_prefill=True))
    assert list(record["details"]) == ["finish_reason", "generated_tokens", "inputs", "prefill", "tokens"]
    assert record["details"]["prefill"] == [{"id": 5, "text": "Hel", "logprob": None},
                                            {"id": 6, "text": "lo", "logprob": -1.5},
                                            {"id": 9, "text": "é", "logprob": -0.25}]
    assert [t["id"] for t in record["details"]["tokens"]] == [7, 8]


def test_legacy_generated_top_tokens() -> None:
    events = [ev(0, 5, "Hel", -0.1, top=(TopLogprob(5, -0.1), TopLogprob(6, -3.0))),
              ev(0, 6, "lo", -0.2, finish=FinishReason.LENGTH, generated=2, top=(TopLogprob(6, -0.2),))]
    record = legacy.generated(events, "p", ctx(LegacyContext, want_logprobs=True, want_top_tokens=True))
    assert record["details"]["top_tokens"] == [
        [{"id": 5, "text": "Hel", "log_prob": -0.1, "special": False},
         {"id": 6, "text": "lo", "log_prob": -3.0, "special": False}],
        [{"id": 6, "text": "lo", "log_prob": -0.2, "special": False}]]


def test_legacy_generated_error_raises() -> None:
    with pytest.raises(EngineError, match="boom"):
        legacy.generated([ev(0, None, "", finish=FinishReason.ERROR, error="boom")], "p", ctx(LegacyContext))


def test_legacy_lines_exact() -> None:
    lines = list(legacy.generated_lines(hello_events(), "Say", ctx(LegacyContext)))
    assert lines == [
        {"token": {"id": 5, "text": "Hel", "log_prob": -0.1, "special": False}, "generated_text": None,
         "details": None},
        {"token": {"id": 6, "text": "lo", "log_prob": -0.2, "special": False}, "generated_text": None, "details": None},
        {"token": {"id": 7, "text": " wor", "log_prob": -0.3, "special": False}, "generated_text": None,
         "details": None},
        {"token": {"id": 8, "text": "ld", "log_prob": -0.4, "special": False}, "generated_text": None, "details": None},
        {"token": {"id": 2, "text": "", "log_prob": -0.01, "special": True}, "generated_text": "Hello world",
         "details": None},
    ]


def test_legacy_lines_last_carries_joined_text_and_details() -> None:
    events = [ev(0, 5, "", -0.1), ev(0, 6, "Hel", -0.2), ev(0, 9, "loé", -0.3, finish=FinishReason.STOP, generated=3)]
    lines = list(legacy.generated_lines(events, "p: ", ctx(LegacyContext, want_logprobs=True, return_full_text=True)))
    assert [line["generated_text"] for line in lines] == [None, None, "p: Helloé"]
    assert "".join(line["token"]["text"] for line in lines) == "Helloé"
    assert lines[-1]["details"] == {"finish_reason": "stop_sequence", "generated_tokens": 3}
    assert [line["details"] for line in lines[:-1]] == [None, None]


def test_legacy_lines_top_tokens_per_line() -> None:
    events = [ev(0, 5, "Hel", -0.1, top=(TopLogprob(5, -0.1),), finish=FinishReason.LENGTH, generated=1)]
    (line,) = legacy.generated_lines(events, "p", ctx(LegacyContext, want_top_tokens=True))
    assert line["top_tokens"] == [{"id": 5, "text": "Hel", "log_prob": -0.1, "special": False}]


@pytest.mark.parametrize("finish", [FinishReason.ERROR, FinishReason.ABORT])
def test_legacy_lines_error_mid_stream(finish: FinishReason) -> None:
    events = iter([ev(0, 5, "Hel", -0.1), ev(0, None, "", finish=finish, error="boom", generated=1),
                   ev(0, 6, "lo", -0.2)])
    lines = list(legacy.generated_lines(events, "p", ctx(LegacyContext)))
    assert len(lines) == 2
    assert lines[-1]["token"] == {"id": -1, "text": "", "log_prob": None, "special": True}
    assert lines[-1]["generated_text"] is None
    assert lines[-1]["details"] == {"finish_reason": "error", "generated_tokens": 1}
    assert lines[-1]["error"] == "boom"


def test_legacy_error_line_helper() -> None:
    assert error_record(EngineError("oops"), ErrorShape.LMI_LINE) == {
        "token": {"id": -1, "text": "", "log_prob": None, "special": True}, "generated_text": None,
        "details": {"finish_reason": "error", "generated_tokens": 0}, "error": "oops"}


# ---- framing --------------------------------------------------------------------------------------------------

RECORDS = [{"a": 1, "text": "é 日本 😀"}, {"b": [1, 2], "nested": {"x": None}}, {"s": "line\nbreak"}]


def test_jsonlines_exact_bytes() -> None:
    frames = list(jsonlines(RECORDS))
    assert frames == [
        '{"a":1,"text":"é 日本 😀"}\n'.encode(),
        b'{"b":[1,2],"nested":{"x":null}}\n',
        b'{"s":"line\\nbreak"}\n',
    ]
    assert JSONLINES_MIMETYPE == "application/jsonlines"


def test_jsonlines_each_frame_is_one_valid_json_line() -> None:
    data = b"".join(jsonlines(RECORDS))
    lines = data.split(b"\n")
    assert lines[-1] == b""
    assert [json.loads(line) for line in lines[:-1]] == RECORDS
    assert "日本".encode() in data  # UTF-8, not \\u escapes


def test_sse_exact_bytes() -> None:
    frames = list(sse(RECORDS[:2]))
    assert frames == [
        'data: {"a":1,"text":"é 日本 😀"}\n\n'.encode(),
        b'data: {"b":[1,2],"nested":{"x":null}}\n\n',
        b"data: [DONE]\n\n",
    ]
    assert SSE_MIMETYPE == "text/event-stream"


def test_sse_of_nothing_is_just_done() -> None:
    assert list(sse([])) == [b"data: [DONE]\n\n"]


def test_chat_stream_through_sse_ends_with_error_then_done() -> None:
    events = [ev(0, 5, "Hel", -0.1), ev(0, None, "", finish=FinishReason.ERROR, error="boom")]
    data = b"".join(sse(chat.chat_chunks(events, 1, ctx())))
    frames = data.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    assert json.loads(frames[-3][len(b"data: "):]) == {"error": {
        "message": "generation failed: boom", "type": "internal_error", "param": None, "code": None}}
