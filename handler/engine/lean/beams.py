"""Beam requests in the step loop.

A beam request runs ``beam.width`` sequences: its prompt is prefilled once and forked, as ``n`` choices are, and
every beam then decodes a row in each step beside everything else. Its rows do not go to the sampler: they go to
the request's ``core.beam.BeamSearch``, which picks the next beams; a beam that continues another's history takes a
copy of that beam's cache (fork on divergence; a pruned beam's slot is reused), and each slot's sequence takes its
beam's tokens. Beams are placed with room for the whole answer and are never preempted, so all of a request's beams
are in every step. When the search is done, the ``n`` best hypotheses are replayed through fresh ``Sequence``s
(text, stops and special tokens as for any choice) and sent as the request's choices; the beams' slots are freed.
"""

from __future__ import annotations

import logging

import torch

from handler.engine.backend import EngineLimits
from handler.engine.core.beam import BeamSearch, GroupBeamSearch, Hypothesis, new_search, send_hypotheses
from handler.engine.core.request import RequestState, Sequence, Vocabulary
from handler.engine.core.sampler import beam_logprobs
from handler.engine.lean.scheduler import Scheduler
from handler.engine.types import ErrorKind, FinishReason, TokenEvent

log = logging.getLogger(__name__)


class BeamSteps:
    """The step loop's beam requests (one per loop; runs on the engine thread)."""

    def __init__(self, vocab: Vocabulary, limits: EngineLimits, scheduler: Scheduler) -> None:
        self.vocab, self.limits, self.scheduler = vocab, limits, scheduler
        self.num_sampled = 0  # beam tokens chosen since the step loop last took the count

    def step(self, sequences: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """Advance every beam request among ``sequences``; return the other sequences and their logits rows."""
        others, other_rows = [], []
        groups: dict[int, tuple[RequestState, list[tuple[Sequence, int]]]] = {}
        for row, sequence in enumerate(sequences):
            if sequence.is_beam:
                groups.setdefault(id(sequence.request), (sequence.request, []))[1].append((sequence, row))
            else:
                others.append(sequence)
                other_rows.append(row)
        for state, members in groups.values():
            try:
                self._advance(state, sorted(members, key=lambda member: member[0].index), logits)
            except Exception as error:  # this request ends; the batch goes on
                log.exception("beam search step failed")
                self.end(state, FinishReason.ERROR, f"beam search failed: {type(error).__name__}", ErrorKind.MODEL)
        return others, logits[other_rows] if len(other_rows) != len(sequences) else logits

    def _advance(self, state: RequestState, members: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
        beams = [sequence for sequence, _row in members]
        if [s.index for s in beams] != list(range(state.num_sequences)):
            raise RuntimeError(f"beam rows {[s.index for s in beams]} are not the request's {state.num_sequences}")
        logprobs = beam_logprobs(logits[[row for _sequence, row in members]], [s.row for s in beams])
        if not torch.isfinite(logprobs).any(dim=-1).all():
            self.end(state, FinishReason.ERROR, "the model produced non-finite logits", ErrorKind.MODEL)
            return
        if state.beams is None:
            state.beams = new_search(state.request, self.vocab.eos_token_ids, beams[0].max_new_tokens)
        search: BeamSearch | GroupBeamSearch = state.beams
        result = search.step(logprobs)
        for source, target in result.copies:
            self.scheduler.space.copy(beams[source], beams[target], beams[source].num_cached)
        for sequence in beams:
            sequence.row.output_ids[:] = search.tokens_of(sequence.index)
        self.num_sampled += len(beams)
        if result.done:
            self._send(state, search.best(state.n), None)

    def end(self, state: RequestState, reason: FinishReason, error: str | None, kind: ErrorKind) -> None:
        """End a beam request early: past its deadline with the best beams so far (``DEADLINE``), else every
        choice with ``reason`` (cancelled, failed, stopping)."""
        if state.choices_ended:
            return
        if reason is FinishReason.DEADLINE and state.beams is not None:
            self._send(state, state.beams.best_so_far(state.n), FinishReason.DEADLINE)
            return
        for index in range(state.n):
            state.events.put(TokenEvent(index=index, token_id=None, text="", finish_reason=reason, error=error,
                                        error_kind=kind if error else None,
                                        num_prompt_tokens=state.num_prompt_tokens))
        self._free(state, reason)

    def _send(self, state: RequestState, hypotheses: list[Hypothesis], cut: FinishReason | None) -> None:
        send_hypotheses(state, hypotheses, cut, self.vocab, self.limits.max_model_len)
        self._free(state, cut or FinishReason.EOS)

    def _free(self, state: RequestState, reason: FinishReason) -> None:
        state.choices_ended = True
        for sequence in state.sequences:
            if sequence.finish_reason is None:
                sequence.finish_reason = reason
            self.scheduler.remove(sequence)
