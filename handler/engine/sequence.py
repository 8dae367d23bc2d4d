"""Per-request and per-choice engine state, and the handle a caller reads events from.

A ``RequestState`` is one submitted ``GenerationRequest``; it owns ``n`` ``Sequence``s (one per choice) once its
prompt has been prefilled. A sequence is finished exactly when its ``finish_reason`` is set.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from handler.engine.detokenizer import IncrementalDetokenizer
from handler.engine.sampler import RowState
from handler.engine.types import ErrorKind, FinishReason, GenerationRequest, TokenEvent

_POLL_SECONDS = 1.0


@dataclass(slots=True, eq=False)
class Sequence:
    """One choice of one request: its tokens, its cache slot and how far its prompt is cached."""

    request: RequestState
    index: int
    row: RowState
    detokenizer: IncrementalDetokenizer
    max_new_tokens: int
    slot: int = -1
    num_cached: int = 0
    num_cached_prefix: int = 0       # leading prompt tokens whose KV comes from the runner's shared-prefix cache
    finish_reason: FinishReason | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.row.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.row.output_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.row.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.row.output_ids)

    @property
    def next_token(self) -> int:
        """The token whose KV the next decode step computes (a placeholder while prefilling)."""
        return self.output_ids[-1] if not self.is_prefilling else self.prompt_ids[self.num_cached]


@dataclass(slots=True, eq=False)
class RequestState:
    """A submitted request, shared by the engine thread and the thread that reads its events."""

    request: GenerationRequest
    make_sequence: Callable[[RequestState, int], Sequence]
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    sequences: list[Sequence] = field(default_factory=list)

    def new_sequence(self, index: int) -> Sequence:
        sequence = self.make_sequence(self, index)
        self.sequences.append(sequence)
        return sequence


class RequestHandle:
    """What ``Engine.submit`` returns: iterate it for ``TokenEvent``s; ``cancel()`` when the client is gone."""

    def __init__(self, state: RequestState, is_engine_alive: Callable[[], bool]) -> None:
        self._state = state
        self._is_engine_alive = is_engine_alive

    @property
    def request(self) -> GenerationRequest:
        return self._state.request

    def cancel(self) -> None:
        self._state.cancelled.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        remaining = self._state.request.n
        while remaining:
            event = self._next_event()
            if event is None:
                yield from self._engine_died(remaining)
                return
            yield event
            remaining -= event.finish_reason is not None

    def _next_event(self) -> TokenEvent | None:
        while True:
            try:
                return self._state.events.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if not self._is_engine_alive():
                    return None

    def _engine_died(self, remaining: int) -> Iterator[TokenEvent]:
        finished = {s.index for s in self._state.sequences if s.finish_reason is not None}
        pending = [i for i in range(self._state.request.n) if i not in finished][:remaining]
        for index in pending:
            yield TokenEvent(index=index, token_id=None, text="", finish_reason=FinishReason.ERROR,
                             error="the generation engine stopped", error_kind=ErrorKind.STOPPED,
                             num_prompt_tokens=len(self.request.prompt_ids))


def make_generator(seed: int | None, index: int) -> torch.Generator | None:
    """Choice ``index`` of a seeded request draws from seed + index, so choices differ but repeat exactly."""
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed + index) % (2**63))
