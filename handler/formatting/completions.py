"""Token events -> completions JSON (OpenAI's shape): one ``text_completion`` object, or ``text_completion`` chunks.

With several prompts, choices are numbered prompt-major (prompt i, choice j -> index ``i * n + j``), as OpenAI does,
and usage is summed over the prompts. ``logprobs`` is OpenAI's legacy object: ``tokens``, ``token_logprobs``,
``top_logprobs`` (``{token: logprob}``: the most likely tokens and the chosen one, so up to logprobs + 1 entries) and
``text_offset`` (where each token starts in the choice's ``text``; special tokens add no text). It has one entry per
generated token, the end-of-sequence token included, so its length is the choice's completion tokens. With echo it
covers the prompt's tokens first, the first one's logprob and top logprobs null (OpenAI's legacy shape, what
lm-evaluation-harness slices by context length); streamed, the echoed prompt and its logprobs are one chunk per
choice. ``max_tokens: 0`` with echo (``ctx.is_echo_only``) drops the one token generated: the prompt alone, no
completion tokens billed.

vLLM's ``prompt_logprobs`` adds each choice's ``prompt_logprobs``: per prompt token null (the first) or
``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt's token and the most likely ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from handler.engine.types import FinishReason, PromptLogprob, TokenEvent
from handler.formatting.chat import SYSTEM_FINGERPRINT
from handler.formatting.context import (
    OPENAI_FINISH_REASONS,
    ChoiceResult,
    FormatContext,
    best_choices,
    failure_record,
    fold,
    usage,
)


@dataclass(frozen=True, slots=True)
class CompletionsContext(FormatContext):
    want_logprobs: bool = False          # logprobs is set
    include_usage: bool = False          # stream_options.include_usage
    keep_best: int | None = None         # best_of: keep this many choices, the most likely first (None: all)
    prompt_texts: tuple[str, ...] = ()   # the prompts as sent, one per prompt (what echo prepends)
    return_full_text: bool = False       # echo
    suffix: str = ""                     # appended to every completion
    num_logprobs: int = 0                # logprobs: the top logprobs of each token (with echo, the prompt's too)
    is_echo_only: bool = False           # max_tokens 0 with echo: the prompt alone, the token generated dropped
    num_prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (None: not asked)


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
        usages.append(_usage([c.finish for c in candidates], ctx))
    return {**_base(ctx), "choices": choices, "usage": _summed(usages)}


def completion_chunks(events: Iterable[TokenEvent], n: int, ctx: CompletionsContext) -> Iterator[dict]:
    """``text_completion`` chunks: the echoed prompt first (with echo; with logprobs too, once each choice's first
    event brings the prompt's), then text as it is released; the suffix rides on each choice's last chunk, which
    carries its finish_reason; with include_usage, a usage chunk ends it."""
    echo_waits = ctx.return_full_text and ctx.want_logprobs
    if ctx.return_full_text and not echo_waits:
        for index in range(n):
            yield _chunk(ctx, index, ctx.prompt_texts[0])
    unechoed = set(range(n)) if echo_waits else set()
    offsets = [0] * n  # text_offset: characters of token text so far, per choice
    finals = []
    for event in events:
        if (failure := failure_record(event)) is not None:
            yield failure
            return
        if event.index in unechoed:
            unechoed.discard(event.index)
            offsets[event.index] = len(ctx.prompt_texts[0])
            yield _chunk(ctx, event.index, ctx.prompt_texts[0], prompt_legacy_logprobs(event.prompt_logprobs, ctx))
        yield from _event_chunk(event, ctx, offsets)
        if event.finish_reason is not None:
            finals.append(event)
    if ctx.include_usage:
        yield {**_base(ctx), "choices": [], "usage": _usage(finals, ctx)}


def _event_chunk(event: TokenEvent, ctx: CompletionsContext, offsets: list[int]) -> Iterator[dict]:
    """The chunk an event makes, if any: its text and logprobs (advancing its choice's text offset), and on the
    choice's last the suffix and finish_reason."""
    if ctx.is_echo_only:  # the one token generated is not part of the answer, which max_tokens (0) cut
        event = replace(event, token_id=None, text="", finish_reason=event.finish_reason and FinishReason.LENGTH)
    logprobs = None
    if ctx.want_logprobs and event.token_id is not None:
        logprobs, offsets[event.index] = legacy_logprobs([event], ctx, offsets[event.index])
    finish = OPENAI_FINISH_REASONS.get(event.finish_reason) if event.finish_reason else None
    text = event.text + (ctx.suffix if finish else "")
    if text or logprobs or finish:
        yield _chunk(ctx, event.index, text, logprobs, finish)


def legacy_logprobs(events: Iterable[TokenEvent], ctx: FormatContext, offset: int = 0) -> tuple[dict, int]:
    """OpenAI's legacy logprobs object for these token events, and the text offset after the last of them."""
    return _legacy_record(events, ctx, offset, None)


def prompt_legacy_logprobs(entries: Sequence[PromptLogprob], ctx: CompletionsContext) -> dict:
    """The legacy logprobs object of an echoed prompt: its first token has no logprob and no top logprobs (null);
    the others' top logprobs hold the ``logprobs`` most likely tokens and the prompt's own."""
    return _legacy_record(entries, ctx, 0, ctx.num_logprobs)[0]


def _legacy_record(entries: Iterable[TokenEvent | PromptLogprob], ctx: FormatContext, offset: int,
                   num_top: int | None) -> tuple[dict, int]:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` for generated tokens (``num_top`` None: every
    alternative kept) or prompt tokens (``num_top`` of them; a prompt token without a logprob, the first, has null
    top logprobs)."""
    record: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        token = ctx.token_text(entry.token_id)
        top = None
        if entry.logprob is not None or num_top is None:
            top = {ctx.token_text(t.token_id): t.logprob for t in entry.top_logprobs[:num_top]}
            top.setdefault(token, entry.logprob)
        record["tokens"].append(token)
        record["token_logprobs"].append(entry.logprob)
        record["top_logprobs"].append(top)
        record["text_offset"].append(offset)
        offset += 0 if entry.is_special else len(token)
    return record, offset


def vllm_prompt_logprobs(entries: Sequence[PromptLogprob], ctx: CompletionsContext) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token null (the first) or ``{id: {logprob, rank, decoded_token}}`` of
    the prompt's token, then the ``ctx.num_prompt_logprobs`` most likely (ranks 1..k)."""
    found: list[dict | None] = []
    for entry in entries:
        if entry.logprob is None:
            found.append(None)
            continue
        tokens = {str(entry.token_id): _vllm_logprob(entry.token_id, entry.logprob, entry.rank, ctx)}
        for rank, top in enumerate(entry.top_logprobs[:ctx.num_prompt_logprobs], start=1):
            tokens.setdefault(str(top.token_id), _vllm_logprob(top.token_id, top.logprob, rank, ctx))
        found.append(tokens)
    return found


def _vllm_logprob(token_id: int, logprob: float, rank: int | None, ctx: CompletionsContext) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": ctx.token_text(token_id)}


def _choice(choice: ChoiceResult, index: int, echoed: str, ctx: CompletionsContext) -> dict:
    generated = [] if ctx.is_echo_only else choice.token_events
    record = {
        "index": index,
        "text": echoed + ("" if ctx.is_echo_only else choice.text) + ctx.suffix,
        "logprobs": _choice_logprobs(choice, generated, echoed, ctx) if ctx.want_logprobs else None,
        "finish_reason": "length" if ctx.is_echo_only else OPENAI_FINISH_REASONS[choice.finish.finish_reason],
    }
    if ctx.num_prompt_logprobs is not None:
        record["prompt_logprobs"] = vllm_prompt_logprobs(_prompt_of(choice), ctx)
    return record


def _choice_logprobs(choice: ChoiceResult, generated: list[TokenEvent], echoed: str, ctx: CompletionsContext) -> dict:
    """The generated tokens' legacy logprobs, after the echoed prompt's when echo is on."""
    completion = legacy_logprobs(generated, ctx, len(echoed))[0]
    if not ctx.return_full_text:
        return completion
    prompt = prompt_legacy_logprobs(_prompt_of(choice), ctx)
    return {key: prompt[key] + completion[key] for key in prompt}


def _prompt_of(choice: ChoiceResult) -> tuple[PromptLogprob, ...]:
    """The prompt's logprobs, which the choice's first token event carries."""
    tokens = choice.token_events
    return tokens[0].prompt_logprobs if tokens else ()


def _usage(finals: list[TokenEvent], ctx: CompletionsContext) -> dict:
    """Usage; with echo only, the one token generated and dropped is not billed."""
    counted = usage(finals)
    if ctx.is_echo_only:
        counted.update(completion_tokens=0, total_tokens=counted["prompt_tokens"])
    return counted


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
