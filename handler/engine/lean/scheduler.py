"""Which sequences run in the next step, where their KV lives, and who waits.

Every step decodes one token for every running sequence and spends what is left of the per-step token budget on
prefill, a chunk deep in a long prompt counting its attention too (so a step takes about as long at any depth, and
sequences decoding beside a long prompt's prefill keep getting tokens at a steady pace). The oldest piece of work is
served first with a quarter of the budget, so a stream of short requests cannot starve a long one; then the prompts
that complete in this step, cheapest first (fewest tokens left to compute, then the oldest); then, cheapest first,
chunks of the rest, unless a request that joined the batch in this step completes its prompt in it: that step
carries no other unfinished prefill than the oldest's quarter, so it takes a fraction of a full step.

The bound that gives (docs/configuration.md, "KV memory"): a request whose prompt fits what a step leaves it (the budget
less the decode rows and the oldest's quarter; shared with others arriving together), and whose slot fits, gets its
first token from the first step that starts after it arrives, whatever long prompts are prefilling; its time to first
token is at most the rest of the step in progress plus one short step.

Priorities (``GenerationRequest.priority``, lower first) come before all of that: admission and prefill go to the
best priority first, and within one priority as above (its oldest first with the quarter, then the cheapest). A
request that better priorities pass is not starved: every step in which newer work is admitted or prefilled while
it gets nothing counts, and after ``MAX_PASSED_STEPS`` such steps it ranks with the best, oldest first, so it is
the next admitted (and gets the quarter). Memory preempts the worst priority first, the newest among equals.

Memory is the KV space's (``runners.kv_space.KVSpace``, or ``Unbounded`` for a runner that keeps its own caches): a
request is admitted only when its prompt's slot fits. When a decoding sequence outgrows its slot and the budget has
no room, the newest running sequences are preempted (their slots freed; they wait at the front and recompute what
they had when memory frees up), never an out-of-memory and never a lost request. While the oldest waiting work does
not fit, nothing newer is admitted past it. Waiting requests that are cancelled or past their deadline are taken out
of the queue here; the engine ends them.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from handler.engine.core.request import RequestState, Sequence
from handler.engine.runners.base import StepPlan, Unbounded

# A step always leaves at least this many prompt tokens for waiting requests, so a full decode batch cannot
# starve them.
_MIN_PREFILL_TOKENS = 32
# Steps a request may get nothing while newer work is admitted or prefilled (better priorities passing it) before
# it ranks with the best priority
MAX_PASSED_STEPS = 16


class Scheduler:
    def __init__(self, max_running: int, max_step_tokens: int,
                 match_prefix: Callable[[Sequence], None] = lambda sequence: None) -> None:
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        # keys one token of prefill attention reads for the cost of its other work (``model.attention_tokens``):
        # a step's prefill is budgeted by cost, so a step at the end of a long prompt takes about as long as one at
        # its start and the decoding sequences beside it are not held up
        self.attention_tokens = 1 << 62
        # the lean model's KEY_BLOCK where its prefill attention computes a partly filled block of query positions
        # whole (``attention.MatmulAttention``), so a chunk's ragged end would be paid for twice, by its step and the
        # next (measured: a 1024-token prompt in 37-token chunks took 1.2x the prefill time, in 256-token ones
        # 1.02x); 1 where the attention kernel runs
        self.chunk_align = 1
        self.match_prefix = match_prefix   # sets a new sequence's num_cached from a cached prefix
        self.space = Unbounded()
        self.waiting: deque[RequestState] = deque()
        self.preempted: list[Sequence] = []  # to resume, oldest first
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.queue_times: list[float] = []  # seconds each request admitted since the last stats waited (``stats``)
        self._arrivals = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    @property
    def has_running(self) -> bool:
        return bool(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.preempted)

    @property
    def num_cached_tokens(self) -> int:
        """Cache positions that running sequences hold."""
        return sum(s.num_cached for s in self.running)

    @property
    def num_reserved(self) -> int:
        """Sequences running now plus the choices prefilling requests will fork into."""
        return sum(_choices(s) for s in self.running)

    def add(self, state: RequestState) -> None:
        state.order = next(self._arrivals)
        self.waiting.append(state)

    # ---- a step --------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._grow_decoding()
        budget = max(self.max_step_tokens - len(self.running), _MIN_PREFILL_TOKENS)
        chunks: dict[Sequence, int] = {}
        work = [s for s in self.running if s.is_prefilling] + list(self.preempted) + list(self.waiting)
        oldest = min(work, key=lambda item: (_rank(item), _order(item)), default=None)
        step = _Step(budget)
        # the best priority's oldest piece of work first, with a quarter of the budget; then priority by priority,
        # cheapest first, the prompts that complete in this step, then unfinished chunks, unless a new request gets
        # its first token from this step
        self._add(step, oldest, max(budget // 4, 1), chunks)
        for _rank_of, group in itertools.groupby(sorted(work, key=lambda item: (_rank(item), _cost(item))), _rank):
            cheapest = list(group)
            for item in cheapest:
                self._add(step, item, step.budget, chunks, whole=True)
            if not step.first_token:
                for item in cheapest:
                    self._add(step, item, step.budget, chunks)
        _count_passed(work, step.served)
        prefill = [(s, s.num_cached, length) for s, length in chunks.items()]
        return StepPlan(decode=sorted(self.running, key=self.space.sort_key), prefill=prefill)

    def _add(self, step: _Step, item: RequestState | Sequence | None, share: int, chunks: dict[Sequence, int],
             whole: bool = False) -> None:
        """A chunk of ``item``'s prefill of at most ``share`` (``whole``: only one that completes its prompt),
        admitting it first if it waits."""
        if item is None or step.budget <= 1:
            return
        sequence = item if isinstance(item, Sequence) else (item.sequences[0] if item.sequences else None)
        if sequence is None or sequence not in self.running:
            if step.blocked or (whole and self._chunk_cost(0, _cost(item)[0]) > step.budget - 1):
                return
            sequence = self._admit(item)
            if sequence is None:
                step.blocked = True  # nothing newer is admitted past the oldest work that does not fit
                return
            step.budget -= 1  # its decode row (a placeholder while it prefills)
            step.admitted.append(sequence)
            step.served.add(sequence.request)
        done = sequence.num_cached + chunks.get(sequence, 0)
        left, most = sequence.prefill_target - done, min(share, step.budget)
        if self._chunk_cost(done, left) <= most:
            length = left
        elif whole:
            return
        else:
            length = _aligned(done, self._chunk_length(done, most), sequence.prefill_target, self.chunk_align)
        if length > 0:
            chunks[sequence] = chunks.get(sequence, 0) + length
            step.budget -= self._chunk_cost(done, length)
            step.first_token |= length == left and sequence in step.admitted
            step.served.add(sequence.request)

    def _chunk_cost(self, start: int, length: int) -> int:
        """A prefill chunk's cost in token budget: its tokens, and its attention over the keys before it counted
        as ``attention_tokens`` keys to a token (a long prompt's late chunks cost more per token)."""
        return length + length * (start + length) // self.attention_tokens

    def _chunk_length(self, start: int, most: int) -> int:
        """The longest chunk from ``start`` whose cost stays within ``most`` (at least one token)."""
        length = most
        while length > 1 and self._chunk_cost(start, length) > most:
            length = max(1, most * length // self._chunk_cost(start, length))
        return length

    def _grow_decoding(self) -> None:
        """Every decoding sequence gets room for the position it computes next; the newest give way."""
        for sequence in sorted(self.running, key=_order):
            if sequence.is_prefilling or sequence not in self.running:
                continue
            while not self.space.grow(sequence, sequence.num_cached + 1):
                victim = max(_movable(self.running, sequence), key=_yield_order)
                self.preempt(victim)
                if victim is sequence:
                    break

    def _admit(self, item: RequestState | Sequence) -> Sequence | None:
        """A waiting request's first sequence, or a preempted one, with its slot; None when it does not fit."""
        if isinstance(item, Sequence):
            if len(self.running) + _choices(item, waiting=True) > self.max_running:
                return None
            sequence = item
            sequence.resume()
        else:
            if self.num_reserved + item.num_sequences > self.max_running:
                return None
            if item.request.beam is None and not self.space.fits(item.num_prompt_tokens + 1):
                return None
            sequence = item.new_sequence(0)
            if item.request.beam is not None and not self.space.fits(sequence.reserve):
                item.sequences.remove(sequence)
                return None
        if not sequence.wants_prompt_logprobs:  # a cached prefix would skip the rows that score the prompt
            self.match_prefix(sequence)
        if not self.space.place(sequence, sequence.reserve):
            sequence.num_cached = sequence.num_cached_prefix = 0
            sequence.prefix_kv = None
            if item is not sequence:
                item.sequences.remove(sequence)
            return None
        if item is sequence:
            self.preempted.remove(sequence)
        else:
            self.waiting.remove(item)
            self.queue_times.append(time.monotonic() - item.queued_at)
        self.running.append(sequence)
        return sequence

    def place_fork(self, child: Sequence, parent: Sequence) -> bool:
        """A forked choice's slot (the engine copies the prompt's KV into it). Newer sequences give way; when
        nothing can, the child waits preempted and computes the prompt itself later."""
        while not self.space.place(child, child.reserve if child.is_beam else parent.num_cached + 1):
            victims = [s for s in _movable(self.running, child) if s.request is not parent.request]
            if not victims:
                if child.is_beam:  # a beam never waits alone: the caller takes its request's beams back
                    return False
                child.preempted()
                self.preempted.append(child)
                self.preempted.sort(key=_order)
                return False
            self.preempt(max(victims, key=_yield_order))
        self.running.append(child)
        return True

    def preempt(self, sequence: Sequence) -> None:
        """Take a running sequence's slot back; it resumes before any waiting request once memory allows."""
        self.running.remove(sequence)
        self.space.free(sequence)
        sequence.preempted()
        self.preempted.append(sequence)
        self.preempted.sort(key=_order)
        self.num_preemptions += 1

    def remove(self, sequence: Sequence) -> None:
        """A finished sequence leaves (running or preempted)."""
        if sequence in self.running:
            self.running.remove(sequence)
            self.space.free(sequence)
        elif sequence in self.preempted:
            self.preempted.remove(sequence)

    # ---- queries and queue surgery --------------------------------------------------------------------------
    def running_sequences(self) -> list[Sequence]:
        """Every started, unfinished sequence: running, then preempted (a copy: finishing one changes the lists)."""
        return self.running + self.preempted

    def running_requests(self) -> list[RequestState]:
        """The requests with started sequences, each once."""
        return list(dict.fromkeys(s.request for s in self.running_sequences()))

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


@dataclass(slots=True)
class _Step:
    """What ``Scheduler.schedule`` has left of a step while it fills it."""

    budget: int
    admitted: list[Sequence] = field(default_factory=list)  # sequences that joined the batch in this step
    blocked: bool = False       # the oldest waiting work did not fit: nothing newer is admitted
    first_token: bool = False   # a sequence admitted in this step completes its prompt in it
    served: set[RequestState] = field(default_factory=set)  # requests admitted or given a chunk in this step


def _choices(sequence: Sequence, waiting: bool = False) -> int:
    """Slots a running (or resuming) sequence stands for: a request's first choice or beam, before its prompt
    completes and it forks, all of them."""
    if sequence.index == 0 and not sequence.output_ids and (waiting or sequence.is_prefilling):
        return sequence.request.num_sequences
    return 1


def _movable(running: list[Sequence], needing: Sequence) -> list[Sequence]:
    """The sequences that may be preempted for ``needing``: never a beam (its request's beams step together), the
    one that needs the room itself excepted (it waits)."""
    return [s for s in running if not s.is_beam or s is needing]


def _order(item: RequestState | Sequence) -> tuple[int, int]:
    return item.order if isinstance(item, Sequence) else (item.order, 0)


def _state(item: RequestState | Sequence) -> RequestState:
    return item.request if isinstance(item, Sequence) else item


def _rank(item: RequestState | Sequence) -> tuple[int, int]:
    """Who goes first: a request passed ``MAX_PASSED_STEPS`` times ranks with the best; else by priority."""
    state = _state(item)
    return (0, 0) if state.passed >= MAX_PASSED_STEPS else (1, state.priority)


def _yield_order(sequence: Sequence) -> tuple[int, tuple[int, int]]:
    """Which running sequence gives way to memory first: the worst priority, then the newest."""
    return sequence.request.priority, _order(sequence)


def _count_passed(work: list[RequestState | Sequence], served: set[RequestState]) -> None:
    """A step in which newer work was admitted or prefilled counts against each older request it left with nothing."""
    newest = max((state.order for state in served), default=-1)
    for state in {_state(item) for item in work} - served:
        if state.order < newest:
            state.passed += 1


def _cost(item: RequestState | Sequence) -> tuple[int, tuple[int, int]]:
    """Tokens left to prefill (a waiting request's whole prompt), then age."""
    if isinstance(item, Sequence):
        return item.prefill_target - item.num_cached, item.order
    return item.num_prompt_tokens, (item.order, 0)


def _aligned(start: int, length: int, target: int, align: int) -> int:
    """A prefill chunk that is not a prompt's last and crosses a multiple of ``align`` ends at the last one it
    crosses (``Scheduler.chunk_align``)."""
    end = start + length
    if end >= target:
        return length
    cut = end - end % align
    return cut - start if cut > start else length
