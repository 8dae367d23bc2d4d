"""What every schema's formatter shares: the context base (ids, names, how to spell a token), folding a request's
events into choices, what a failed event means, and usage.

Each schema's own context sits next to its formatter (``ChatContext`` in ``chat``, ...).

May import (the whole ``formatting`` room): ``handler.errors``, ``handler.engine.types`` and ``handler.parsing``
(reading tool calls and reasoning out of the text). Not ``handler.prompt`` and not ``handler.protocol``: a
formatter gets what it needs from its context, filled in by the endpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from handler.engine.types import ErrorKind, FinishReason, TokenEvent
from handler.errors import EngineError, ErrorShape, NotReady, ServingError, error_record

# OpenAI's finish reasons (chat and completions); the legacy schema has TGI's own
OPENAI_FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


@dataclass(frozen=True, slots=True)
class FormatContext:
    """What every schema's formatter needs: the ids and names of the answer, and how to spell a token."""

    request_id: str
    model: str
    created: int
    token_text: Callable[[int], str]
    token_bytes: Callable[[int], bytes]


@dataclass(slots=True)
class ChoiceResult:
    """One choice folded from its events."""

    index: int
    text: str = ""
    events: list[TokenEvent] = field(default_factory=list)
    finish: TokenEvent | None = None

    @property
    def token_events(self) -> list[TokenEvent]:
        return [e for e in self.events if e.token_id is not None]


def fold(events: Iterable[TokenEvent], n: int) -> list[ChoiceResult]:
    """Collect a request's events per choice; a failed choice raises (a non-streaming answer cannot be partial)."""
    choices = [ChoiceResult(i) for i in range(n)]
    for event in events:
        choice = choices[event.index]
        choice.events.append(event)
        choice.text += event.text
        if event.finish_reason is not None:
            choice.finish = event
            raise_for_failure(event)
    return choices


def best_choices(choices: list[ChoiceResult], n: int) -> list[ChoiceResult]:
    """``best_of`` (vLLM's rule): the ``n`` choices with the highest cumulative logprob, the best first, re-indexed
    ``0..n-1`` in that order (ties keep their order)."""
    ranked = sorted(choices, key=cumulative_logprob, reverse=True)[:n]
    return [replace(choice, index=index) for index, choice in enumerate(ranked)]


def cumulative_logprob(choice: ChoiceResult) -> float:
    """The sum of the chosen tokens' logprobs: the log of the choice's probability under the sampler."""
    return sum(e.logprob for e in choice.token_events if e.logprob is not None)


def failure(event: TokenEvent) -> ServingError | None:
    """The error a final event stands for (None when it ended normally): the engine stopping (SIGTERM) is a 503,
    any other failure a 500."""
    if event.finish_reason is FinishReason.ERROR and event.error_kind is ErrorKind.STOPPED:
        return NotReady(event.error or "the server is stopping")
    if event.finish_reason is FinishReason.ERROR:
        return EngineError(f"generation failed: {event.error}")
    if event.finish_reason is FinishReason.ABORT:
        return NotReady("the request was cancelled because the server is stopping")
    return None


def raise_for_failure(event: TokenEvent) -> None:
    error = failure(event)
    if error is not None:
        raise error


def usage(choices_final: Iterable[TokenEvent], reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage; with a reasoning model, ``completion_tokens_details.reasoning_tokens`` (part of
    ``completion_tokens``, as OpenAI counts them)."""
    finals = list(choices_final)
    prompt = finals[0].num_prompt_tokens if finals else 0
    completion = sum(e.num_generated_tokens for e in finals)
    counted = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if reasoning_tokens is not None:
        counted["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counted


def finals_of(events: Iterable[TokenEvent]) -> Iterator[TokenEvent]:
    return (e for e in events if e.finish_reason is not None)


def failure_record(event: TokenEvent) -> dict | None:
    """The final error record of an OpenAI-shaped stream when ``event`` ends its choice in failure, else None."""
    if event.finish_reason not in (FinishReason.ERROR, FinishReason.ABORT):
        return None
    if event.error_kind is ErrorKind.STOPPED:  # SIGTERM's grace ran out: a 503's shape, the client may retry
        return error_record(failure(event), ErrorShape.OPENAI)
    error = EngineError(f"generation failed: {event.error or 'the request was cancelled'}")
    return error_record(error, ErrorShape.OPENAI)
