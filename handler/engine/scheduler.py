"""Which sequences run in the next step, and which cache slot each one holds.

Every step decodes one token for every running sequence, and spends what is left of the per-step token budget
on prompt prefill: first for sequences whose long prompt is part-way through (chunked prefill), then for new
requests, oldest first, while slots are free. Running sequences hold slots ``0..n-1`` with no holes: when one
leaves, the last slot's sequence moves into its place. Waiting requests that are cancelled or past their deadline
are taken out of the queue here; the engine ends them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from handler.engine.sequence import RequestState, Sequence

# A step always leaves at least this many prompt tokens for waiting requests, so a full decode batch cannot
# starve them.
_MIN_PREFILL_TOKENS = 32


@dataclass(slots=True)
class StepPlan:
    """One step: a decode row for every slot (in slot order), then prefill chunks ``(sequence, start, length)``."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int, int]]

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass(slots=True, frozen=True)
class SlotMove:
    src: int
    dst: int
    length: int


class Scheduler:
    def __init__(self, max_running: int, max_step_tokens: int,
                 cached_prefix_length: Callable[[list[int]], int] = lambda ids: 0) -> None:
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.cached_prefix_length = cached_prefix_length
        self.waiting: deque[RequestState] = deque()
        self.slots: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.slots)

    @property
    def has_running(self) -> bool:
        return bool(self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_cached_tokens(self) -> int:
        """Cache positions that running sequences hold."""
        return sum(s.num_cached for s in self.slots)

    @property
    def num_reserved(self) -> int:
        """Slots held now plus those the prefilling requests will fork into."""
        return sum(s.request.n if s.is_prefilling else 1 for s in self.slots)

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def schedule(self) -> StepPlan:
        budget = max(self.max_step_tokens - len(self.slots), _MIN_PREFILL_TOKENS)
        prefill = []
        for sequence in self.slots:
            if sequence.is_prefilling and budget > 0:
                length = min(sequence.num_prompt_tokens - sequence.num_cached, budget)
                prefill.append((sequence, sequence.num_cached, length))
                budget -= length
        while self.waiting and budget > 1 and self.num_reserved + self.waiting[0].n <= self.max_running:
            sequence = self._admit(self.waiting.popleft())
            length = min(sequence.num_prompt_tokens - sequence.num_cached, budget - 1)
            prefill.append((sequence, sequence.num_cached, length))
            budget -= length + 1  # its slot also gets a (placeholder) decode row this step
        return StepPlan(decode=list(self.slots), prefill=prefill)

    def _admit(self, state: RequestState) -> Sequence:
        sequence = state.new_sequence(0)
        sequence.num_cached = sequence.num_cached_prefix = self.cached_prefix_length(sequence.prompt_ids)
        self.place(sequence)
        return sequence

    def place(self, sequence: Sequence) -> None:
        sequence.slot = len(self.slots)
        self.slots.append(sequence)

    def remove(self, sequence: Sequence) -> SlotMove | None:
        """Free a finished sequence's slot; returns the cache copy that keeps the slots contiguous."""
        hole, last = sequence.slot, self.slots.pop()
        sequence.slot = -1
        if last is sequence:
            return None
        self.slots[hole] = last
        last.slot = hole
        return SlotMove(src=len(self.slots), dst=hole, length=last.num_cached)

    def running_sequences(self) -> list[Sequence]:
        """The running sequences in slot order (a copy: finishing one moves another into its slot)."""
        return list(self.slots)

    def running_requests(self) -> list[RequestState]:
        """The requests holding slots, each once, in the order of their first slot."""
        return list(dict.fromkeys(s.request for s in self.slots))

    def take_cancelled_waiting(self) -> list[RequestState]:
        return self._take_waiting(lambda state: state.cancelled.is_set())

    def take_waiting(self) -> list[RequestState]:
        """Every waiting request (the engine is stopping)."""
        return self._take_waiting(lambda state: True)

    def take_expired(self, now: float) -> list[RequestState]:
        """Waiting requests whose deadline is ``now`` or earlier."""
        return self._take_waiting(lambda state: state.deadline <= now)

    def _take_waiting(self, is_taken: Callable[[RequestState], bool]) -> list[RequestState]:
        # one test per request: a cancel from another thread between two tests would drop it from the queue untaken
        taken: list[RequestState] = []
        kept: deque[RequestState] = deque()
        for state in self.waiting:
            (taken if is_taken(state) else kept).append(state)
        self.waiting = kept
        return taken
