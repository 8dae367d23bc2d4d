"""The vLLM backend's requests in flight (``InFlight``), on its asyncio loop: each request's tasks (one a choice, or
one for all its beams) in arrival order, which requests hold slots, and how a request ends before vLLM ends it.

A request holds slots once it is among the first ``max_running`` choices or beams in flight, first come, first
served (``VllmRequestState.has_slot``); a request whose tasks have all ended leaves its slots to the next. A
request ends early when cancelled (``FinishReason.ABORT``), overdue (``RequestState.end_overdue``; a beam search
answers with its best beams so far) or stopped: its tasks are cancelled, which aborts it in vLLM, and every
unfinished choice gets its last event. The backend's watcher calls ``end_cancelled_and_overdue`` every turn.

Loop thread only. Imports: the engine's ``backend`` and ``types``, ``core`` (requests, admission) and this package's
runners of choices (``requests``) and beams (``beams``); vLLM itself only through them.
"""

from __future__ import annotations

import asyncio
import threading
import time

from handler.engine.backend import EngineLimits
from handler.engine.core.admission import AdmissionControl
from handler.engine.core.request import RequestState, Vocabulary
from handler.engine.types import ErrorKind, FinishReason
from handler.engine.vllm.beams import BeamRunner
from handler.engine.vllm.requests import ChoiceRunner, VllmRequestState


class InFlight:
    """The requests in flight and their slots; ``queue_times``: seconds each request given a slot since the last
    report waited for it."""

    def __init__(self, limits: EngineLimits, admission: AdmissionControl, stopping: threading.Event) -> None:
        self.limits, self._admission, self._stopping = limits, admission, stopping
        self.live: dict[VllmRequestState, list[asyncio.Task]] = {}   # in arrival order
        self.choices: ChoiceRunner | None = None   # once vLLM has started (``run_on``)
        self.beams: BeamRunner | None = None       # beam requests
        self.queue_times: list[float] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def run_on(self, loop: asyncio.AbstractEventLoop, engine, vocab: Vocabulary, vocab_size: int) -> None:
        """vLLM has started: requests run as tasks on ``loop`` against ``engine`` (an ``AsyncLLM``)."""
        self._loop = loop
        self.choices = ChoiceRunner(engine, vocab, self.limits, self.forget)
        self.beams = BeamRunner(engine, vocab, vocab_size, self.limits, self.forget)

    @property
    def running(self) -> list[VllmRequestState]:
        """The requests holding slots."""
        return [s for s in self.live if s.has_slot]

    @property
    def num_sampled(self) -> int:
        """Tokens the choices and beams accepted since the last report."""
        return self.choices.num_sampled + self.beams.num_sampled

    def mark_reported(self) -> None:
        """The counts so far went to the listener: the next report counts from here."""
        self.choices.num_sampled = self.beams.num_sampled = 0
        self.queue_times.clear()

    def begin(self, state: VllmRequestState) -> None:
        if state.cancelled.is_set() or self._stopping.is_set():
            state.finish_unstarted(FinishReason.ABORT)
            return
        if state.request.beam is not None:  # one task runs all the beams
            self.live[state] = [self._loop.create_task(self.beams.run(state))]
        else:
            self.live[state] = [self._loop.create_task(self.choices.run(state, i)) for i in range(state.n)]
        self.grant_slots()

    def grant_slots(self) -> None:
        """Mark the requests vLLM has room for (first come, first served up to ``max_running`` choices or beams)."""
        free = self.limits.max_running
        for state in self.live:
            if free < state.num_sequences:
                return
            free -= state.num_sequences
            if not state.has_slot:
                self.queue_times.append(time.monotonic() - state.queued_at)
            state.has_slot = True

    def forget(self, state: RequestState) -> None:
        """A task of ``state`` ended: once all have, the request leaves its slots."""
        tasks = self.live.get(state)
        if tasks is not None and all(t.done() or t is asyncio.current_task() for t in tasks):
            del self.live[state]
            self.grant_slots()

    def end(self, state: RequestState, reason: FinishReason, message: str | None, kind: ErrorKind | None) -> None:
        """End every unfinished choice of ``state`` now (cancelled, overdue, stopping) and abort it in vLLM."""
        state.is_expired = reason is FinishReason.ERROR
        for task in self.live.pop(state, []):
            task.cancel()
        self.grant_slots()
        if kind is ErrorKind.TIMEOUT:
            if self.beams.cut(state):  # a beam search answers with its best beams so far
                return
            state.end_overdue(self.choices.finish, message)
            return
        for sequence in state.sequences:
            if sequence.finish_reason is None:
                self.choices.finish(sequence, reason, error=message, error_kind=kind or ErrorKind.MODEL)
        state.finish_unstarted(reason, message, kind)

    def end_cancelled_and_overdue(self) -> None:
        """The lean engine's per-step checks: cancelled requests end with ABORT, overdue ones with TIMEOUT."""
        now = time.monotonic()
        for state in list(self.live):
            if state.cancelled.is_set():
                self.end(state, FinishReason.ABORT, None, None)
            elif state.deadline <= now:
                self.end(state, FinishReason.ERROR, self._admission.timeout_error(), ErrorKind.TIMEOUT)

    def end_all(self, reason: str | None) -> None:
        """End every request in flight: with ``reason`` an ``ErrorKind.STOPPED`` error each, else ABORT."""
        for state in list(self.live):
            if reason is not None:
                self.end(state, FinishReason.ERROR, reason, ErrorKind.STOPPED)
            else:
                self.end(state, FinishReason.ABORT, None, None)
