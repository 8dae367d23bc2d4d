"""Token events -> chat-completions JSON (OpenAI shape): one ``chat.completion`` or ``chat.completion.chunk``s.

With a reasoning model (``ChatContext.reasoning_parser``) each choice's text is split first (``parsing.reasoning``):
the reasoning goes to ``message.reasoning`` / ``delta.reasoning`` (vLLM's name) and ``reasoning_content`` (llama.cpp
and SGLang clients read this one), the answer to ``content``, where tool calls are parsed as without reasoning. A
choice that ends inside its reasoning has ``content: null``. ``usage.completion_tokens_details.reasoning_tokens``
counts the tokens generated while the reasoning was open.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from handler.engine.types import FinishReason, TokenEvent
from handler.formatting.context import (
    OPENAI_FINISH_REASONS,
    ChoiceResult,
    FormatContext,
    best_choices,
    failure_record,
    finals_of,
    fold,
    usage,
)
from handler.parsing import reasoning
from handler.parsing.dialects import ToolCall
from handler.parsing.tool_stream import CallDelta, ToolCallStream, parse_tool_calls

SYSTEM_FINGERPRINT = "fp_sagemaker_llm_container"


@dataclass(frozen=True, slots=True)
class ChatContext(FormatContext):
    want_logprobs: bool = False          # logprobs
    include_usage: bool = False          # stream_options.include_usage
    keep_best: int | None = None         # best_of: keep this many choices, the most likely first (None: all)
    tool_format: str | None = None       # parse tool calls in this format (None: the text is all content)
    tool_calls_only: bool = False        # a forced call, so no content (a call cut by max_tokens is dropped)
    reasoning_parser: str | None = None  # split reasoning from content in this format (parsing.reasoning)
    reasoning_opened: bool = False       # the prompt opened the reasoning: the output starts inside it


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
    splits = {c.index: split_choice(c, ctx) for c in candidates} if ctx.reasoning_parser else {}
    reasoning_tokens = sum(s.num_reasoning_tokens for s in splits.values()) if ctx.reasoning_parser else None
    if ctx.keep_best and splits:
        splits = {c.index: split_choice(c, ctx) for c in choices}
    return {
        "id": ctx.request_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [_choice(c, ctx, splits.get(c.index)) for c in choices],
        "usage": usage((c.finish for c in candidates), reasoning_tokens),
    }


@dataclass(slots=True)
class ReasoningSplit:
    """One whole choice split: its reasoning, its answer text, gpt-oss's calls, and whether it ended inside the
    reasoning."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    in_reasoning: bool = False
    num_reasoning_tokens: int = 0


def split_choice(choice: ChoiceResult, ctx: ChatContext) -> ReasoningSplit:
    splitter = reasoning.splitter(ctx.reasoning_parser, ctx.reasoning_opened)
    split = ReasoningSplit()
    for event in choice.events:
        split.num_reasoning_tokens += splitter.in_reasoning and event.token_id is not None
        _add(split, splitter.push(event.text))
    _add(split, splitter.finish())
    split.in_reasoning = splitter.in_reasoning
    return split


def _add(split: ReasoningSplit, pieces: list[reasoning.Piece]) -> None:
    for piece in pieces:
        if piece.kind == reasoning.REASONING:
            split.reasoning += piece.text
        elif piece.kind == reasoning.TOOL_CALL:
            split.calls.append(ToolCall(piece.name or "", piece.text))
        else:
            split.content += piece.text


def _choice(choice: ChoiceResult, ctx: ChatContext, split: ReasoningSplit | None = None) -> dict:
    text = choice.text if split is None else split.content
    message, finish_reason = _message(text, choice.finish.finish_reason, ctx)
    if split is not None:
        _add_reasoning(message, split)
        if split.calls and choice.finish.finish_reason is not FinishReason.LENGTH:
            finish_reason = "tool_calls"
    logprobs = None
    if ctx.want_logprobs:
        logprobs = {"content": [token_logprob(e, ctx) for e in choice.token_events if not e.is_special]}
    return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def _message(text: str, reason: FinishReason, ctx: ChatContext) -> tuple[dict, str]:
    """``message`` and ``finish_reason`` of one choice; with tools, calls are parsed out of the text."""
    if ctx.tool_format is None:
        return {"role": "assistant", "content": text}, OPENAI_FINISH_REASONS[reason]
    parsed = parse_tool_calls(text, ctx.tool_format, calls_only=ctx.tool_calls_only)
    message = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.calls]
    return message, _finish_reason(reason, bool(parsed.calls))


def _add_reasoning(message: dict, split: ReasoningSplit) -> None:
    """The reasoning fields of a message, and ``content: null`` when the choice ended inside its reasoning."""
    if split.in_reasoning:
        message["content"] = None
    message["reasoning"] = message["reasoning_content"] = split.reasoning or None
    if split.calls:
        message["tool_calls"] = message.get("tool_calls", []) + [call.to_openai() for call in split.calls]


def _finish_reason(reason: FinishReason, has_calls: bool) -> str:
    return "tool_calls" if has_calls and reason is not FinishReason.LENGTH else OPENAI_FINISH_REASONS[reason]


def chat_chunks(events: Iterable[TokenEvent], n: int, ctx: ChatContext) -> Iterator[dict]:
    """``chat.completion.chunk`` records: a role delta first, content (or tool-call) deltas, then a finish_reason
    per choice."""
    for index in range(n):
        yield _chunk(ctx, index, {"role": "assistant", "content": ""})
    streams = [_DeltaStream(ctx) for _ in range(n)]
    finals = []
    for event in events:
        if (failure := failure_record(event)) is not None:
            yield failure
            return
        logprobs = None
        if ctx.want_logprobs and event.token_id is not None and not event.is_special:
            logprobs = {"content": [token_logprob(event, ctx)]}
        stream = streams[event.index]
        deltas = stream.push(event.text, is_last=event.finish_reason is not None, has_token=event.token_id is not None)
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
        reasoning_tokens = sum(s.num_reasoning_tokens for s in streams) if ctx.reasoning_parser else None
        yield {**_base(ctx), "choices": [], "usage": usage(finals_of(finals), reasoning_tokens)}


class _DeltaStream:
    """One choice's text as chunk deltas: content as it comes, or, with tools, content and whole tool calls; with a
    reasoning model, reasoning deltas first split off."""

    def __init__(self, ctx: ChatContext) -> None:
        tool_format = ctx.tool_format
        self._parser = ToolCallStream(tool_format, calls_only=ctx.tool_calls_only) if tool_format else None
        self._splitter = (reasoning.splitter(ctx.reasoning_parser, ctx.reasoning_opened) if ctx.reasoning_parser
                          else None)
        self.num_calls = 0
        self.num_reasoning_tokens = 0

    def push(self, text: str, *, is_last: bool, has_token: bool = True) -> list[dict]:
        if self._splitter is None:
            return self._content(text, is_last)
        self.num_reasoning_tokens += self._splitter.in_reasoning and has_token
        pieces = self._splitter.push(text) + (self._splitter.finish() if is_last else [])
        deltas: list[dict] = []
        for piece in pieces:
            if piece.kind == reasoning.REASONING:
                deltas.append({"reasoning": piece.text, "reasoning_content": piece.text})
            elif piece.kind == reasoning.TOOL_CALL:
                call = ToolCall(piece.name or "", piece.text)
                deltas.append({"tool_calls": [{"index": self.num_calls, **call.to_openai()}]})
                self.num_calls += 1
            else:
                deltas += self._content(piece.text, False)
        return deltas + (self._content("", True) if is_last else [])

    def _content(self, text: str, is_last: bool) -> list[dict]:
        if self._parser is None:
            return [{"content": text}] if text else []
        found = self._parser.push(text) + (self._parser.finish() if is_last else [])
        deltas = []
        for delta in found:
            if isinstance(delta, CallDelta):
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
