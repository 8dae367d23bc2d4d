"""Token events -> chat-completions JSON (OpenAI shape): one ``chat.completion`` or ``chat.completion.chunk``s."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from handler.engine.types import ErrorKind, FinishReason, TokenEvent
from handler.errors import EngineError, ServingError
from handler.formatting.context import (
    OPENAI_FINISH_REASONS,
    ChatContext,
    ChoiceResult,
    FormatContext,
    best_choices,
    failure,
    finals_of,
    fold,
    usage,
)
from handler.prompt import tool_calls

SYSTEM_FINGERPRINT = "fp_sagemaker_llm_container"


def token_logprob(event: TokenEvent, ctx: FormatContext) -> dict:
    """One entry of OpenAI's ``logprobs.content``."""
    return {
        **_token_entry(event.token_id, event.logprob, ctx),
        "top_logprobs": [_token_entry(t.token_id, t.logprob, ctx) for t in event.top_logprobs],
    }


def _token_entry(token_id: int, logprob: float | None, ctx: FormatContext) -> dict:
    return {"token": ctx.token_text(token_id), "logprob": logprob, "bytes": list(ctx.token_bytes(token_id))}


def chat_completion(events: Iterable[TokenEvent], n: int, ctx: ChatContext) -> dict:
    """Fold a request's events into one ``chat.completion`` object (with best_of: the most likely choices; usage
    counts every candidate's tokens, as OpenAI bills them)."""
    candidates = fold(events, n)
    choices = best_choices(candidates, ctx.keep_best) if ctx.keep_best else candidates
    return {
        "id": ctx.request_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [_choice(c, ctx) for c in choices],
        "usage": usage(c.finish for c in candidates),
    }


def _choice(choice: ChoiceResult, ctx: ChatContext) -> dict:
    message, finish_reason = _message(choice.text, choice.finish.finish_reason, ctx)
    logprobs = None
    if ctx.want_logprobs:
        logprobs = {"content": [token_logprob(e, ctx) for e in choice.token_events if not e.is_special]}
    return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def _message(text: str, reason: FinishReason, ctx: ChatContext) -> tuple[dict, str]:
    """``message`` and ``finish_reason`` of one choice; with tools, calls are parsed out of the text."""
    if ctx.tool_format is None:
        return {"role": "assistant", "content": text}, OPENAI_FINISH_REASONS[reason]
    parsed = tool_calls.parse_tool_calls(text, ctx.tool_format, calls_only=ctx.tool_calls_only)
    message = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.calls]
    return message, _finish_reason(reason, bool(parsed.calls))


def _finish_reason(reason: FinishReason, has_calls: bool) -> str:
    return "tool_calls" if has_calls and reason is not FinishReason.LENGTH else OPENAI_FINISH_REASONS[reason]


def chat_chunks(events: Iterable[TokenEvent], n: int, ctx: ChatContext) -> Iterator[dict]:
    """``chat.completion.chunk`` records: a role delta first, content (or tool-call) deltas, then a finish_reason
    per choice."""
    for index in range(n):
        yield _chunk(ctx, index, {"role": "assistant", "content": ""})
    streams = [_DeltaStream(ctx.tool_format, ctx.tool_calls_only) for _ in range(n)]
    finals = []
    for event in events:
        if (failure := failure_record(event)) is not None:
            yield failure
            return
        logprobs = None
        if ctx.want_logprobs and event.token_id is not None and not event.is_special:
            logprobs = {"content": [token_logprob(event, ctx)]}
        stream = streams[event.index]
        deltas = stream.push(event.text, is_last=event.finish_reason is not None)
        for delta in deltas[:-1]:
            yield _chunk(ctx, event.index, delta)
        last = deltas[-1] if deltas else {}
        finish = _finish_reason(event.finish_reason, stream.num_calls > 0) if event.finish_reason else None
        if finish and "tool_calls" in last:  # as OpenAI: the finish comes in a chunk of its own after the call
            yield _chunk(ctx, event.index, last, logprobs)
            last, logprobs = {}, None
        if last or logprobs or finish:
            yield _chunk(ctx, event.index, last, logprobs, finish)
        if event.finish_reason is not None:
            finals.append(event)
    if ctx.include_usage:
        yield {**_base(ctx), "choices": [], "usage": usage(finals_of(finals))}


class _DeltaStream:
    """One choice's text as chunk deltas: content as it comes, or, with tools, content and whole tool calls."""

    def __init__(self, tool_format: str | None, calls_only: bool) -> None:
        self._parser = tool_calls.ToolCallStream(tool_format, calls_only=calls_only) if tool_format else None
        self.num_calls = 0

    def push(self, text: str, *, is_last: bool) -> list[dict]:
        if self._parser is None:
            return [{"content": text}] if text else []
        found = self._parser.push(text) + (self._parser.finish() if is_last else [])
        deltas = []
        for delta in found:
            if isinstance(delta, tool_calls.CallDelta):
                self.num_calls += 1
                deltas.append({"tool_calls": [{"index": delta.index, **delta.call.to_openai()}]})
            elif delta.text:
                deltas.append({"content": delta.text})
        return deltas


def _base(ctx: ChatContext) -> dict:
    return {"id": ctx.request_id, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model,
            "system_fingerprint": SYSTEM_FINGERPRINT}


def _chunk(ctx: ChatContext, index: int, delta: dict, logprobs: dict | None = None,
           finish_reason: str | None = None) -> dict:
    record = {**_base(ctx), "choices": [
        {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if ctx.include_usage:
        record["usage"] = None
    return record


def error_record(error: ServingError) -> dict:
    """The chat shape of an error: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": error.to_dict()}


def failure_record(event: TokenEvent) -> dict | None:
    """The final error record of an OpenAI-shaped stream when ``event`` ends its choice in failure, else None."""
    if event.finish_reason not in (FinishReason.ERROR, FinishReason.ABORT):
        return None
    if event.error_kind is ErrorKind.STOPPED:  # SIGTERM's grace ran out: a 503's shape, the client may retry
        return error_record(failure(event))
    return error_record(EngineError(f"generation failed: {event.error or 'the request was cancelled'}"))
