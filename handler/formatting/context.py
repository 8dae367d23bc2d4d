"""What formatters need besides the events: ids, names, and how to spell a token."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from handler.engine.types import FinishReason, TokenEvent
from handler.errors import EngineError, NotReady


@dataclass(frozen=True, slots=True)
class FormatContext:
    request_id: str
    model: str
    created: int
    token_text: Callable[[int], str]
    token_bytes: Callable[[int], bytes]
    want_logprobs: bool = False          # chat: logprobs; legacy: details
    include_usage: bool = False          # chat stream_options.include_usage
    prompt_texts: tuple[str, ...] = ()   # legacy: return_full_text / details.inputs
    return_full_text: bool = False
    want_top_tokens: bool = False        # legacy: top_n_tokens


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


def raise_for_failure(event: TokenEvent) -> None:
    if event.finish_reason is FinishReason.ERROR:
        raise EngineError(f"generation failed: {event.error}")
    if event.finish_reason is FinishReason.ABORT:
        raise NotReady("the request was cancelled because the server is stopping")


def usage(choices_final: Iterable[TokenEvent]) -> dict:
    finals = list(choices_final)
    prompt = finals[0].num_prompt_tokens if finals else 0
    completion = sum(e.num_generated_tokens for e in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finals_of(events: Iterable[TokenEvent]) -> Iterator[TokenEvent]:
    return (e for e in events if e.finish_reason is not None)
