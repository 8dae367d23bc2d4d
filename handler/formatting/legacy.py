"""Token events -> the legacy schema (LMI / TGI): ``generated_text`` objects, or one JSON line per token.

With ``decoder_input_details``, ``details.prefill`` lists the prompt's tokens as TGI does: ``{"id", "text",
"logprob"}`` (TGI's key, not LMI's ``log_prob``), the first token's logprob null.

TGI's spelling (``LegacyContext.is_tgi``: ``option.legacy_response=tgi``, TGI's own routes, TGI's clients) differs
from LMI's in a few names, which TGI's clients (``huggingface_hub.InferenceClient``, ``text_generation``) parse:
tokens carry ``logprob``; stream records count themselves in ``index`` (from 1) and the last one's ``details`` are
``{finish_reason, generated_tokens, seed, input_length}``; ``details`` always has ``prefill`` and ``seed`` and no
``inputs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from handler.engine.types import FinishReason, TokenEvent
from handler.errors import EngineError, ErrorShape, error_record
from handler.formatting.context import ChoiceResult, FormatContext, fold

FINISH_REASONS = {FinishReason.EOS: "eos_token", FinishReason.STOP: "stop_sequence", FinishReason.LENGTH: "length",
                  FinishReason.ERROR: "error", FinishReason.ABORT: "error"}


@dataclass(frozen=True, slots=True)
class LegacyContext(FormatContext):
    want_logprobs: bool = False          # details (or decoder_input_details)
    want_prefill: bool = False           # decoder_input_details: the prompt's tokens in details.prefill
    return_full_text: bool = False       # return_full_text: the prompt before the generated text
    want_top_tokens: bool = False        # top_n_tokens
    is_tgi: bool = False                 # TGI's spelling: "logprob", stream "index", details' "seed" / "input_length"
    seed: int | None = None              # the request's seed (TGI's details report it)

    @property
    def error_shape(self) -> ErrorShape:
        """How a stream in this spelling ends when it fails: its last line."""
        return ErrorShape.TGI_LINE if self.is_tgi else ErrorShape.LMI_LINE


def _token(event: TokenEvent, text: str, ctx: LegacyContext) -> dict:
    return {"id": event.token_id, "text": text, _logprob_key(ctx): event.logprob, "special": event.is_special}


def _logprob_key(ctx: LegacyContext) -> str:
    return "logprob" if ctx.is_tgi else "log_prob"


def _top_tokens(event: TokenEvent, ctx: LegacyContext) -> list[dict]:
    return [{"id": t.token_id, "text": ctx.token_text(t.token_id), _logprob_key(ctx): t.logprob,
             "special": False} for t in event.top_logprobs]


def _details(choice: ChoiceResult, prompt: str, ctx: LegacyContext) -> dict:
    tokens = choice.token_events
    details = {
        "finish_reason": FINISH_REASONS[choice.finish.finish_reason],
        "generated_tokens": choice.finish.num_generated_tokens,
        **({"seed": ctx.seed, "prefill": []} if ctx.is_tgi else {"inputs": prompt}),
    }
    if ctx.want_prefill:  # the prompt's logprobs ride on the first token's event
        prefill = tokens[0].prompt_logprobs if tokens else ()
        details["prefill"] = [{"id": p.token_id, "text": ctx.token_text(p.token_id), "logprob": p.logprob}
                              for p in prefill]
    details["tokens"] = [_token(e, ctx.token_text(e.token_id), ctx) for e in tokens]
    if ctx.want_top_tokens:
        details["top_tokens"] = [_top_tokens(e, ctx) for e in tokens]
    return details


def generated(events: Iterable[TokenEvent], prompt: str, ctx: LegacyContext) -> dict:
    """One prompt's ``{"generated_text": ..., "details"?: ...}``."""
    choice = fold(events, 1)[0]
    record = {"generated_text": (prompt if ctx.return_full_text else "") + choice.text}
    if ctx.want_logprobs:
        record["details"] = _details(choice, prompt, ctx)
    return record


def generated_lines(events: Iterable[TokenEvent], prompt: str, ctx: LegacyContext) -> Iterator[dict]:
    """One record per token; the last also carries ``generated_text`` (and ``details`` when asked)."""
    text = prompt if ctx.return_full_text else ""
    for number, event in enumerate(events, start=1):
        text += event.text
        line = {"token": _token(event, event.text, ctx), "generated_text": None, "details": None}
        if ctx.is_tgi:
            line = {"index": number, **line}
        if ctx.want_top_tokens and event.token_id is not None:
            line["top_tokens"] = _top_tokens(event, ctx)
        if event.finish_reason is None:
            yield line
            continue
        if event.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            yield _error_line(event, ctx)
            return
        line["generated_text"] = text
        if ctx.want_logprobs:
            line["details"] = {"finish_reason": FINISH_REASONS[event.finish_reason],
                               "generated_tokens": event.num_generated_tokens}
            if ctx.is_tgi:
                line["details"].update(seed=ctx.seed, input_length=event.num_prompt_tokens)
        yield line


def _error_line(event: TokenEvent, ctx: LegacyContext) -> dict:
    error = EngineError(event.error or "the request was cancelled because the server is stopping")
    return error_record(error, ctx.error_shape, num_generated_tokens=event.num_generated_tokens)
