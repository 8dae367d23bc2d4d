"""Where the step loop's choices reach their requests (``Emitter``): each sampled token, accepted by the choice's
``Sequence``, goes onto its request's event queue, and each choice's end (finished, failed, cancelled, overdue,
stopped) is its last event, with usage, and frees its slot in the scheduler (a beam's end is its whole request's,
``BeamSteps.end``).

The step loop (``steps.StepLoop``) samples and hands each row here; the engine's checks between steps (cancelled
requests, deadlines) end requests here too. Imports: ``core`` (requests, the sampler's result, admission), the lean
scheduler, beams and speculator whose slots and drafts a finished choice lets go; never a runner or torch.
"""

from __future__ import annotations

import dataclasses

from handler.engine.core.admission import AdmissionControl
from handler.engine.core.request import RequestState, Sequence
from handler.engine.core.sampler import SampleResult
from handler.engine.lean.beams import BeamSteps
from handler.engine.lean.scheduler import Scheduler
from handler.engine.lean.speculate import Speculator
from handler.engine.types import ErrorKind, FinishReason, TokenEvent, TopLogprob


class Emitter:
    """Each choice's events onto its request's queue, and its end; ``num_sampled`` counts the tokens emitted since
    the last report (the report resets it)."""

    def __init__(self, scheduler: Scheduler, beams: BeamSteps, speculator: Speculator | None,
                 admission: AdmissionControl) -> None:
        self.scheduler, self.beams, self.speculator, self.admission = scheduler, beams, speculator, admission
        self.num_sampled = 0

    def emit(self, sequence: Sequence, result: SampleResult, row: int) -> None:
        """Row ``row`` of ``result`` for ``sequence``: its token accepted, or the choice ended with the row's error."""
        if row in result.bad_rows:
            self.finish(sequence, FinishReason.ERROR, error="the model produced non-finite logits")
        elif row in result.blocked_rows:
            self.finish(sequence, FinishReason.ERROR, error="the output grammar allows no further token")
        else:
            self._append(sequence, result, row)

    def _append(self, sequence: Sequence, result: SampleResult, row: int) -> None:
        self.num_sampled += 1
        top = tuple(TopLogprob(t, lp) for t, lp in result.top_logprobs[row])
        accepted = sequence.accept(result.token_ids[row], result.logprobs[row], top)
        if accepted.finish_reason is None:
            sequence.request.events.put(accepted.event)
        else:
            self.finish(sequence, accepted.finish_reason, event=accepted.event, error=accepted.error)

    def finish(self, sequence: Sequence, reason: FinishReason, *, event: TokenEvent | None = None,
               error: str | None = None, error_kind: ErrorKind = ErrorKind.MODEL) -> None:
        """End a choice and free its slot: its last event carries the reason (and the error, if any) and usage. A
        beam ends its whole request (``BeamSteps.end``)."""
        if sequence.is_beam:
            self.beams.end(sequence.request, reason, error, error_kind)
            return
        if self.speculator is not None:
            self.speculator.speculation.drafter.forget(sequence)
        sequence.finish_reason = reason
        self.scheduler.remove(sequence)
        base = event or TokenEvent(index=sequence.index, token_id=None, text="")
        sequence.request.events.put(dataclasses.replace(
            base, finish_reason=reason, error=error, error_kind=error_kind if error else None,
            num_prompt_tokens=sequence.num_prompt_tokens,
            num_generated_tokens=len(sequence.output_ids)))

    def drop_cancelled(self) -> None:
        """End every cancelled request, waiting (never started) or running (``FinishReason.ABORT``)."""
        for state in self.scheduler.take_cancelled_waiting():
            state.finish_unstarted(FinishReason.ABORT)
        for sequence in self.scheduler.running_sequences():
            if sequence.request.cancelled.is_set():
                self.finish(sequence, FinishReason.ABORT)

    def expire_overdue(self) -> None:
        """End every request past its deadline, waiting or running (``RequestState.end_overdue``)."""
        for state in self.admission.take_overdue(self.scheduler):
            state.end_overdue(self.finish, self.admission.timeout_error())

    def end(self, state: RequestState, message: str, kind: ErrorKind) -> None:
        """End every choice of ``state`` with an error event (the engine is stopping, or recovering)."""
        state.is_expired = True
        for sequence in list(state.sequences):
            if sequence.finish_reason is None:
                self.finish(sequence, FinishReason.ERROR, error=message, error_kind=kind)
        state.finish_unstarted(FinishReason.ERROR, message, kind)  # choices not forked yet, or never admitted
