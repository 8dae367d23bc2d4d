"""Token events -> completions JSON (OpenAI's shape): one ``text_completion`` object, or ``text_completion`` chunks.

With several prompts, choices are numbered prompt-major (prompt i, choice j -> index ``i * n + j``), as OpenAI does,
and usage is summed over the prompts. ``logprobs`` is OpenAI's legacy object: ``tokens``, ``token_logprobs``,
``top_logprobs`` (``{token: logprob}``: the most likely tokens and the chosen one, so up to logprobs + 1 entries) and
``text_offset`` (where each token starts in the choice's ``text``; special tokens add no text). It has one entry per
generated token, the end-of-sequence token included, so its length is the choice's completion tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from handler.engine.types import TokenEvent
from handler.formatting.chat import SYSTEM_FINGERPRINT, failure_record
from handler.formatting.context import (
    OPENAI_FINISH_REASONS,
    ChoiceResult,
    CompletionsContext,
    FormatContext,
    best_choices,
    fold,
    usage,
)


def completion(requests: Sequence[Iterable[TokenEvent]], num_choices: int, ctx: CompletionsContext) -> dict:
    """Fold each prompt's events (``num_choices`` per prompt) into one ``text_completion`` object; with best_of
    (``ctx.keep_best``) the most likely are kept, and usage counts every candidate's tokens (OpenAI bills them)."""
    choices: list[dict] = []
    usages: list[dict] = []
    for prompt_index, events in enumerate(requests):
        candidates = fold(events, num_choices)
        kept = best_choices(candidates, ctx.keep_best) if ctx.keep_best else candidates
        echoed = ctx.prompt_texts[prompt_index] if ctx.return_full_text else ""
        choices += [_choice(c, prompt_index * len(kept) + c.index, echoed, ctx) for c in kept]
        usages.append(usage(c.finish for c in candidates))
    return {**_base(ctx), "choices": choices, "usage": _summed(usages)}


def completion_chunks(events: Iterable[TokenEvent], n: int, ctx: CompletionsContext) -> Iterator[dict]:
    """``text_completion`` chunks: the echoed prompt first (with echo), then text as it is released; the suffix
    rides on each choice's last chunk, which carries its finish_reason; with include_usage, a usage chunk ends it."""
    if ctx.return_full_text:
        for index in range(n):
            yield _chunk(ctx, index, ctx.prompt_texts[0])
    offsets = [0] * n  # text_offset: characters of token text so far, per choice
    finals = []
    for event in events:
        if (failure := failure_record(event)) is not None:
            yield failure
            return
        logprobs = None
        if ctx.want_logprobs and event.token_id is not None:
            logprobs, offsets[event.index] = legacy_logprobs([event], ctx, offsets[event.index])
        finish = OPENAI_FINISH_REASONS.get(event.finish_reason) if event.finish_reason else None
        text = event.text + (ctx.suffix if finish else "")
        if text or logprobs or finish:
            yield _chunk(ctx, event.index, text, logprobs, finish)
        if event.finish_reason is not None:
            finals.append(event)
    if ctx.include_usage:
        yield {**_base(ctx), "choices": [], "usage": usage(finals)}


def legacy_logprobs(events: Iterable[TokenEvent], ctx: FormatContext, offset: int = 0) -> tuple[dict, int]:
    """OpenAI's legacy logprobs object for these token events, and the text offset after the last of them."""
    record: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in events:
        token = ctx.token_text(event.token_id)
        top = {ctx.token_text(t.token_id): t.logprob for t in event.top_logprobs}
        top.setdefault(token, event.logprob)
        record["tokens"].append(token)
        record["token_logprobs"].append(event.logprob)
        record["top_logprobs"].append(top)
        record["text_offset"].append(offset)
        offset += 0 if event.is_special else len(token)
    return record, offset


def _choice(choice: ChoiceResult, index: int, echoed: str, ctx: CompletionsContext) -> dict:
    return {
        "index": index,
        "text": echoed + choice.text + ctx.suffix,
        "logprobs": legacy_logprobs(choice.token_events, ctx)[0] if ctx.want_logprobs else None,
        "finish_reason": OPENAI_FINISH_REASONS[choice.finish.finish_reason],
    }


def _summed(usages: list[dict]) -> dict:
    return {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _base(ctx: CompletionsContext) -> dict:
    return {
        "id": ctx.request_id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def _chunk(
    ctx: CompletionsContext, index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None
) -> dict:
    record = {
        **_base(ctx),
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if ctx.include_usage:
        record["usage"] = None
    return record
