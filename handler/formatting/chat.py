"""Token events -> chat-completions JSON (OpenAI shape): one ``chat.completion`` or ``chat.completion.chunk``s."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from handler.engine.types import FinishReason, TokenEvent
from handler.errors import EngineError, ServingError
from handler.formatting.context import FormatContext, finals_of, fold, usage

SYSTEM_FINGERPRINT = "fp_sagemaker_llm_container"
FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def token_logprob(event: TokenEvent, ctx: FormatContext) -> dict:
    """One entry of OpenAI's ``logprobs.content``."""
    return {
        **_token_entry(event.token_id, event.logprob, ctx),
        "top_logprobs": [_token_entry(t.token_id, t.logprob, ctx) for t in event.top_logprobs],
    }


def _token_entry(token_id: int, logprob: float | None, ctx: FormatContext) -> dict:
    return {"token": ctx.token_text(token_id), "logprob": logprob, "bytes": list(ctx.token_bytes(token_id))}


def chat_completion(events: Iterable[TokenEvent], n: int, ctx: FormatContext) -> dict:
    """Fold a request's events into one ``chat.completion`` object."""
    choices = fold(events, n)
    return {
        "id": ctx.request_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": {"content": [token_logprob(e, ctx) for e in c.token_events if not e.is_special]}
            if ctx.want_logprobs else None,
            "finish_reason": FINISH_REASONS[c.finish.finish_reason],
        } for c in choices],
        "usage": usage(c.finish for c in choices),
    }


def chat_chunks(events: Iterable[TokenEvent], n: int, ctx: FormatContext) -> Iterator[dict]:
    """``chat.completion.chunk`` records: a role delta first, content deltas, then a finish_reason per choice."""
    for index in range(n):
        yield _chunk(ctx, index, {"role": "assistant", "content": ""})
    finals = []
    for event in events:
        if event.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            yield error_record(EngineError(f"generation failed: {event.error or 'the request was cancelled'}"))
            return
        logprobs = None
        if ctx.want_logprobs and event.token_id is not None and not event.is_special:
            logprobs = {"content": [token_logprob(event, ctx)]}
        finish = FINISH_REASONS.get(event.finish_reason) if event.finish_reason else None
        if event.text or logprobs or finish:
            yield _chunk(ctx, event.index, {"content": event.text} if event.text else {}, logprobs, finish)
        if event.finish_reason is not None:
            finals.append(event)
    if ctx.include_usage:
        yield {**_base(ctx), "choices": [], "usage": usage(finals_of(finals))}


def _base(ctx: FormatContext) -> dict:
    return {"id": ctx.request_id, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model,
            "system_fingerprint": SYSTEM_FINGERPRINT}


def _chunk(ctx: FormatContext, index: int, delta: dict, logprobs: dict | None = None,
           finish_reason: str | None = None) -> dict:
    record = {**_base(ctx), "choices": [
        {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if ctx.include_usage:
        record["usage"] = None
    return record


def error_record(error: ServingError) -> dict:
    """The chat shape of an error: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": error.to_dict()}
