"""The lean engine's step loop: what the engine thread does with a loaded model, ``schedule -> run -> postprocess``.

Each ``step`` drops cancelled requests and ends overdue ones, asks the scheduler for a plan (decode rows and prefill
chunks under the step's token budget and the KV memory), runs the runner once, and turns the logits into tokens:
sampled in one batch, accepted by each choice's ``Sequence`` (grammar, text, stops), emitted as events, and a
choice's slot freed when it ends (``emit.Emitter``: the events, the ends, cancellations and deadlines). A request
with ``n > 1`` prefills its prompt once and forks its other choices from a copy of that cache. A failure in a step or
in sampling ends the requests it touched, never the loop. What the loop reports to the stats listener is
``report.StepReport``'s.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from handler.engine.backend import EngineLimits
from handler.engine.core import prompt_logprobs
from handler.engine.core.admission import AdmissionControl
from handler.engine.core.embedding import EmbeddingJob, ScoreJob, next_batch
from handler.engine.core.request import RequestState, Sequence, Vocabulary
from handler.engine.core.sampler import sample
from handler.engine.lean.beams import BeamSteps
from handler.engine.lean.emit import Emitter
from handler.engine.lean.report import StepReport
from handler.engine.lean.scheduler import Scheduler
from handler.engine.lean.speculate import Speculation, Speculator
from handler.engine.runners.base import Runner, StepOutput, StepPlan
from handler.engine.types import (
    ErrorKind,
    FinishReason,
    GenerationRequest,
    Pooling,
    StopConditions,
    TokenPair,
)
from handler.errors import EngineError, NotReady

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EndSession:
    """A stateful session ended (closed): its pinned prefix blocks are let go (``Engine.end_session``)."""

    session_id: str


class WarmUpFailed(RuntimeError):
    """The model cannot run a generation step the way requests run it; the server refuses to start (one line)."""


class StepLoop:
    """The scheduler, the runner and the sampler around the requests in flight; runs on the engine thread only."""

    def __init__(self, runner: Runner, vocab: Vocabulary, limits: EngineLimits, admission: AdmissionControl,
                 pooling: Pooling | str = "", speculation: Speculation | None = None) -> None:
        self.runner, self.vocab, self.limits = runner, vocab, limits
        self.pooling = pooling        # how embeddings pool (a str: the model cannot embed)
        self.embeddings: collections.deque[EmbeddingJob] = collections.deque()  # jobs with inputs not yet run
        self.scheduler = Scheduler(limits.max_running, limits.max_step_tokens, runner.match_prefix)
        self.scheduler.space = runner.space
        self.scheduler.attention_tokens = getattr(runner, "attention_tokens", self.scheduler.attention_tokens)
        self.scheduler.chunk_align = getattr(runner, "prefill_align", 1)
        self._beams = BeamSteps(vocab, limits, self.scheduler)
        self.speculator = None if speculation is None else Speculator(
            speculation, runner.space, limits.max_step_tokens, runner.space.sort_key)
        self.emitter = Emitter(self.scheduler, self._beams, self.speculator, admission)  # tokens and ends, as events
        self.report = StepReport(runner, self.scheduler, self.speculator, self.emitter)  # stats for the listener
        self.step_error: Exception | None = None  # the last failure of a runner step (warm-up names it)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.embeddings)

    @property
    def has_running(self) -> bool:
        return self.scheduler.has_running

    def add(self, item: RequestState | EmbeddingJob | EndSession) -> None:
        if isinstance(item, EmbeddingJob):
            self.embeddings.append(item)
        elif isinstance(item, EndSession):
            end = getattr(self.runner, "end_session", None)  # a runner without a prefix store pins nothing
            if end is not None:
                end(item.session_id)
        else:
            self.scheduler.add(item)

    def new_sequence(self, state: RequestState, index: int) -> Sequence:
        return Sequence.create(state, index, self.vocab, self.limits.max_model_len)

    def warm_up(self, generates: bool = True) -> None:
        """Generations before /ping says ready (an encoder: one embedding): one shaped like a lone chat request (the
        shared template prefix copied in, a short prefill, one decoding row); on CUDA then one with every slot
        decoding after a full prefill chunk (the largest step).

        The first requests then pay no first-call costs: on CUDA, kernels load lazily per new shape, and the
        allocator then holds the largest working set. On CPU nothing is shape-specific (measured, the embedded
        model after one 16-token prefill and 1-row steps: the first 4-row and 16-row steps took what the next ones
        did), so the lone request is the whole warm-up; a second one with every slot decoding had cost the start
        1.2 s of its 10 (forking 32 choices, then 32-row steps). It is also the start's check that the model
        can serve at all: a warm-up generation that ends in an error (a forward that raises, non-finite logits) raises
        ``WarmUpFailed`` with the reason, so a model that would fail every request never says it is ready.
        """
        if not generates:  # an encoder: one embedding instead (a cross-encoder: one pair's score)
            if hasattr(self.runner, "score"):
                self.runner.score([TokenPair(tuple(range(1, 9)), 4)])
            else:
                self.runner.embed([tuple(range(1, 9))], self.pooling)
            return
        prefix = self.runner.prefix_ids
        shapes = [(prefix + tuple(range(1, 9)), 1)]
        if getattr(self.runner, "device", None) is not None and self.runner.device.type != "cpu":
            prompt_length = min(self.limits.max_step_tokens, self.limits.max_model_len // 2, 128)
            shapes.append((tuple(range(1, prompt_length + 1)), self.limits.max_running))
        for prompt_ids, n in shapes:
            if len(prompt_ids) + 4 > self.limits.max_model_len:
                continue
            request = GenerationRequest("warm-up", prompt_ids=prompt_ids, n=n,
                                        stop=StopConditions(max_new_tokens=4, ignore_eos=True))
            state = RequestState(request, self.new_sequence)
            self.scheduler.add(state)
            while self.scheduler.has_work:
                self.step()
            self._check_warm_up(state)
        self.emitter.num_sampled = 0  # warm-up tokens are not traffic
        self.runner.clear_prefix_cache()
        self.scheduler.space.release()  # traffic's KV grows from a small slab

    def _check_warm_up(self, state: RequestState) -> None:
        """Raise ``WarmUpFailed`` (one line: the step's own exception when one was raised) if the warm-up failed."""
        while not state.events.empty():
            event = state.events.get_nowait()
            if event.error is not None:
                cause = self.step_error
                reason = f"{type(cause).__name__}: {cause}" if cause is not None else event.error
                raise WarmUpFailed(" ".join(f"the model cannot run a generation step (prefill, then decode, as "
                                            f"requests run): {reason}".split()))

    def step(self) -> int:
        """One engine step: schedule, run the model once, sample and emit. Returns the batch size."""
        self.emitter.drop_cancelled()
        self.emitter.expire_overdue()
        if self.embeddings:
            self._embed()
        plan = self.scheduler.schedule()
        if self.speculator is not None and plan.decode:
            self._draft(plan)
        if not plan.is_empty:
            self._run(plan)
        return len(plan.decode) + len(plan.verify)

    def _draft(self, plan: StepPlan) -> None:
        """Drafts for the step (``speculate``); a drafter that fails costs the step its drafts, nothing else."""
        try:
            self.speculator.draft(plan)
        except Exception:
            log.exception("drafting failed; this step decodes without drafts")
            plan.decode[:] = sorted(plan.decode + list(plan.verify), key=self.scheduler.space.sort_key)
            plan.verify.clear()

    def _run(self, plan: StepPlan) -> None:
        try:
            self._postprocess(self.runner.run(plan))
        except Exception as error:  # the batch's requests end with an error event; the engine goes on
            log.exception("engine step failed")
            self.step_error = error
            message = f"model step failed: {type(error).__name__}"
            for sequence in self.scheduler.running_sequences():
                if sequence.finish_reason is None:
                    self.emitter.finish(sequence, FinishReason.ERROR, error=message)

    def _postprocess(self, output: StepOutput) -> None:
        prompt_logprobs.record(output.prompt_logits, self.vocab.special_token_ids)  # before the first events
        for sequence, drafts, rows in output.verified:
            self._verify(sequence, drafts, rows)
        sequences, logits = self._fork_completed_prompts(output)
        if any(s.is_beam for s in sequences):
            sequences, logits = self._beams.step(sequences, logits)
            self.emitter.num_sampled += self._beams.num_sampled
            self._beams.num_sampled = 0
        if not sequences:
            return
        # sample() adjusts logits in place; keep the originals when a row's parameters could make it fail
        plain = all(s.row.params.is_greedy and not s.row.params.logit_bias and not s.row.params.has_penalties
                    for s in sequences)
        original = None if plain else logits.clone()
        try:
            result = sample(logits, [s.row for s in sequences])
        except Exception:  # find the rows that fail on their own; the rest of the batch goes on
            log.exception("batched sampling failed; sampling row by row")
            self._sample_one_by_one(sequences, logits if original is None else original)
            return
        for row, sequence in enumerate(sequences):
            self.emitter.emit(sequence, result, row)

    def _embed(self) -> None:
        """One forward of queued inputs, in arrival order, up to the step's token budget (no KV is kept): texts to
        embed, or a cross-encoder's pairs to score (``ScoreJob``; a model serves one kind, and a forward runs one)."""
        batch, inputs = next_batch(self.embeddings, self.limits.max_step_tokens)
        if not inputs:
            return
        scores = isinstance(batch[0][0], ScoreJob)
        try:
            vectors = self.runner.score(inputs) if scores else self.runner.embed(inputs, self.pooling)
        except Exception as error:  # these jobs fail; the engine goes on
            log.exception("%s step failed", "scoring" if scores else "embedding")
            for job, _count in batch:
                job.fail(EngineError(f"{'scoring' if scores else 'embedding'} failed: {type(error).__name__}: {error}"))
                if job in self.embeddings:
                    self.embeddings.remove(job)
            return
        row = 0
        for job, count in batch:
            job.put(vectors[row:row + count])
            row += count

    def _verify(self, sequence: Sequence, drafts: tuple[int, ...], logits) -> None:
        """Speculative decoding (``speculate``): sample each row in turn with the sequence's own sampler and accept
        the token; go on while it equals the draft. The cache keeps the positions of the accepted tokens."""
        cached = sequence.num_cached - 1 - len(drafts)  # before the step (``advance`` counted every row)
        accepted = 0
        for row in range(len(drafts) + 1):
            try:
                result = sample(logits[row:row + 1], [sequence.row])
            except Exception as error:
                self.emitter.finish(sequence, FinishReason.ERROR, error=f"sampling failed: {type(error).__name__}")
                break
            self.emitter.emit(sequence, result, 0)
            matched = row < len(drafts) and result.token_ids[0] == drafts[row]
            accepted += matched
            if sequence.finish_reason is not None or not matched:
                break
        self.speculator.num_drafted += len(drafts)
        self.speculator.num_accepted += accepted
        if sequence.finish_reason is None:
            sequence.num_cached = cached + 1 + accepted  # the next token and the accepted drafts; the rest is rewritten
            self.speculator.speculation.drafter.verified(sequence)

    def _sample_one_by_one(self, sequences: list[Sequence], logits) -> None:
        for row, sequence in enumerate(sequences):
            try:
                result = sample(logits[row:row + 1].clone(), [sequence.row])
            except Exception as error:
                self.emitter.finish(sequence, FinishReason.ERROR, error=f"sampling failed: {type(error).__name__}")
                continue
            self.emitter.emit(sequence, result, 0)

    def _fork_completed_prompts(self, output: StepOutput) -> tuple[list[Sequence], object]:
        """A request with n > 1 prefilled its prompt once; its other choices start from a copy of that cache."""
        sequences, rows = [], []
        for row, sequence in enumerate(output.sequences):
            choices = [sequence]
            count = sequence.request.num_sequences
            if not sequence.output_ids and sequence.index == 0 and count > 1:
                forks = [self._fork(sequence, i) for i in range(1, count)]
                choices += [child for child in forks if child is not None]
                if sequence.is_beam and len(choices) < count:  # beams start together or not at all
                    self._take_beams_back(choices)
                    continue
            sequences += choices
            rows += [row] * len(choices)
        return sequences, output.logits[rows] if len(rows) != len(output.sequences) else output.logits

    def _fork(self, parent: Sequence, index: int) -> Sequence | None:
        """Choice ``index`` from a copy of the parent's prompt cache; None when memory made it wait (preempted: it
        computes the prompt itself when it resumes)."""
        child = parent.request.new_sequence(index)
        if not self.scheduler.place_fork(child, parent):
            return None
        child.num_cached = parent.num_cached
        self.scheduler.space.copy(parent, child, parent.num_cached)
        return child

    def _take_beams_back(self, beams: list[Sequence]) -> None:
        """Not every beam found room: the forks leave and the first beam waits preempted, to prefill again and fork
        when memory allows (the logits of this step are dropped)."""
        first = beams[0]
        for child in first.request.sequences[1:]:
            self.scheduler.remove(child)
        first.request.sequences[:] = [first]
        self.scheduler.preempt(first)

    def end_all(self, message: str, kind: ErrorKind = ErrorKind.STOPPED) -> None:
        """End every request, waiting or running, with an error event (the engine is stopping, or recovering)."""
        for state in self.scheduler.take_waiting() + self.scheduler.running_requests():
            self.emitter.end(state, message, kind)
        while self.embeddings:
            self.embeddings.popleft().fail(NotReady(message) if kind is ErrorKind.STOPPED else EngineError(message))
