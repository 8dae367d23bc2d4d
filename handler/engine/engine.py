"""The engine: one background thread owns the model and runs ``schedule -> run -> postprocess`` steps.

Callers on any thread ``submit`` a ``GenerationRequest`` and read ``TokenEvent``s from the returned handle; they
never touch the model or wait on a lock around it. All requests in flight share each model step (continuous
batching): new requests join between steps, finished ones leave at once and free their cache slot.

Each choice's state lives on its ``Sequence``, which also accepts its sampled tokens (grammar, text, stop checks);
the engine samples, emits what the sequence returns, and frees slots. Backpressure (the bounded wait queue and the
per-request deadline) is ``admission.AdmissionControl``'s, driven by the engine's current ``admission`` settings.
The engine reports ``EngineStats`` to one listener after its steps (metrics); it imports nothing of HTTP or
Prometheus.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from handler.engine import prompt_logprobs
from handler.engine.admission import AdmissionControl
from handler.engine.backend import Admission, EngineLimits, EngineStats
from handler.engine.constraints import GrammarCompiler
from handler.engine.runner import ModelRunner, StepOutput
from handler.engine.sampler import SampleResult, sample
from handler.engine.scheduler import Scheduler, StepPlan
from handler.engine.sequence import RequestHandle, RequestState, Sequence, Vocabulary
from handler.engine.types import ErrorKind, FinishReason, GenerationRequest, StopConditions, TokenEvent, TopLogprob
from handler.errors import BadRequest, EngineError, NotReady, Unprocessable

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    """What the loader hands the engine thread: the runner, the tokenizer for detokenising, the EOS ids."""

    runner: ModelRunner
    tokenizer: object           # tokenizers.Tokenizer
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    vocab_size: int
    grammar: GrammarCompiler | None = None    # None: this model cannot constrain its output
    path: str = "lean"                        # which engine path runs the forward: "lean" or "transformers"
    path_reason: str = ""                     # why (option.rolling_batch, or what the lean engine lacks)


NO_LIMITS = Admission()
# KV slabs are given back after this long without a running sequence: allocating (zeroing) a slab costs ~0.15 s
# for 377 MB here, which every request after a short pause paid when they were freed at once
KV_IDLE_RELEASE_S = 30.0


class Engine:
    """The lean engine backend (``backend.EngineBackend``): ``load`` runs on the engine thread and returns the model;
    ``on_stats`` runs on the engine thread after steps and must be quick."""

    def __init__(self, load: Callable[[], LoadedModel], limits: EngineLimits, admission: Admission = NO_LIMITS,
                 on_stats: Callable[[EngineStats], None] | None = None,
                 on_ready: Callable[[], None] = lambda: None,
                 on_failed: Callable[[str], None] = lambda reason: None) -> None:
        self._load = load
        self._on_ready = on_ready
        self._on_failed = on_failed
        self.limits = limits
        self._inbox: queue.SimpleQueue[RequestState | None] = queue.SimpleQueue()
        self._scheduler = Scheduler(limits.max_running, limits.max_step_tokens, self._match_prefix)
        self._loaded: LoadedModel | None = None
        self._vocab: Vocabulary | None = None
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._stop_reason: str | None = None
        self.load_error: str | None = None
        self.admission = admission    # replaceable while running: admission control reads it each time
        self._admission = AdmissionControl(lambda: self.admission)
        self._listener = on_stats
        self._last_stats: EngineStats | None = None
        self._num_sampled = 0         # tokens sampled since the last report
        self._reported = (0, 0, 0)    # prefix-cache queries and hits, and preemptions, at the last report

    # ---- caller side (any thread) -------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._thread.is_alive()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str | None = None) -> None:
        """Stop the engine thread after its current step. With ``reason``, every request still in flight (or
        submitted meanwhile) ends at once with an error event carrying it (``ErrorKind.STOPPED``), so each stream
        gets its final record; without, readers learn within a second that the engine is gone."""
        self._stop_reason = reason
        self._stopping.set()
        self._inbox.put(None)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises ``ServingError`` for one that cannot be served."""
        if not self.is_ready:
            raise NotReady("the model is not ready yet" if not self._stopping.is_set() else "the server is stopping")
        request = self.fit_prompt(request)
        self.validate(request)
        state = RequestState(request, self._new_sequence, deadline=self._admission.deadline(request.arrived_at),
                             matcher=self._compile_grammar(request))
        self._admission.enqueue(state, self._inbox.put)
        return RequestHandle(state, self._thread.is_alive)

    def _compile_grammar(self, request: GenerationRequest):
        if request.grammar is None:
            return None
        if self._loaded.grammar is None:
            raise Unprocessable("this model cannot constrain its output", param=request.grammar.param)
        return self._loaded.grammar.compile(request.grammar)

    def fit_prompt(self, request: GenerationRequest) -> GenerationRequest:
        """With ``truncate_prompt``, drop the prompt's oldest tokens so that it and max_new_tokens (at least one
        token) fit the context (Databricks' ``error_behavior: truncate``)."""
        limit = self.limits.max_model_len
        reserve = min(request.stop.max_new_tokens or 1, limit - 1)
        if not request.truncate_prompt or len(request.prompt_ids) <= limit - reserve:
            return request
        if request.prompt_embeds is not None or request.prompt_images is not None:
            raise BadRequest("a prompt with images cannot be truncated to fit the context; send fewer or smaller "
                             "images", param=request.prompt_param)
        return dataclasses.replace(request, prompt_ids=request.prompt_ids[len(request.prompt_ids) - (limit - reserve):])

    def validate(self, request: GenerationRequest) -> None:
        num_prompt = len(request.prompt_ids)
        if num_prompt == 0:
            raise BadRequest("the prompt is empty after tokenisation", param=request.prompt_param)
        if num_prompt >= self.limits.max_model_len:
            raise BadRequest(f"the prompt has {num_prompt} tokens; this model's context is "
                             f"{self.limits.max_model_len} tokens (option.max_model_len), prompt and completion "
                             "together", param=request.prompt_param)
        if request.n > self.limits.max_running:
            raise BadRequest(f"{request.n} choices (n, or best_of when given) are more than the "
                             f"{self.limits.max_running} sequences this server runs at once "
                             "(option.max_rolling_batch_size)", param="n")
        vocab = self._loaded.vocab_size if self._loaded else None
        if vocab is not None and not 0 <= min(request.prompt_ids) <= max(request.prompt_ids) < vocab:  # token prompts
            raise BadRequest(f"the prompt has a token id outside the vocabulary (0..{vocab - 1})",
                             param=request.prompt_param)
        for token_id, _bias in request.sampling.logit_bias:
            if vocab is not None and not 0 <= token_id < vocab:
                raise BadRequest(f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab - 1})",
                                 param="logit_bias")

    # ---- engine thread ------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._loaded = self._load()
        except Exception as error:  # reported by /ping (503) and in the log; ``on_failed`` decides what follows
            self.load_error = f"{type(error).__name__}: {error}"
            log.exception("model load failed")
            self._on_failed(self.load_error)
            return
        self._vocab = Vocabulary(self._loaded.tokenizer, self._loaded.eos_token_ids, self._loaded.special_token_ids)
        self._scheduler.space = self._loaded.runner.space
        runner = self._loaded.runner
        self._scheduler.attention_tokens = getattr(runner, "attention_tokens", self._scheduler.attention_tokens)
        self._warm_up()
        self._on_ready()
        self._ready.set()
        idle_since = time.monotonic()
        while not self._stopping.is_set():
            self._drain_inbox(block=not self._scheduler.has_work)
            batch_size = self.step() if self._scheduler.has_work else 0
            self._report(batch_size)
            if self._scheduler.has_running:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= KV_IDLE_RELEASE_S:
                self._scheduler.space.release()  # the prefix store stays; it is under the budget too
                idle_since = math.inf
        if self._stop_reason is not None:
            self._drain_inbox(block=False)
            self._end_all(self._stop_reason)

    def _match_prefix(self, sequence: Sequence) -> None:
        self._loaded.runner.match_prefix(sequence)

    def _warm_up(self) -> None:
        """Two generations before /ping says ready: one shaped like a lone chat request (the shared template
        prefix copied in, a short prefill, one decoding row), then one like the largest step (a full prefill chunk,
        then every slot decoding).

        The first requests then pay no first-call costs (on CUDA, kernels load lazily per new shape), and the
        allocator already holds the largest working set.
        """
        prefix = self._loaded.runner.prefix_ids
        prompt_length = min(self.limits.max_step_tokens, self.limits.max_model_len // 2, 128)
        shapes = [(prefix + tuple(range(1, 9)), 1), (tuple(range(1, prompt_length + 1)), self.limits.max_running)]
        for prompt_ids, n in shapes:
            if len(prompt_ids) + 4 > self.limits.max_model_len:
                continue
            request = GenerationRequest("warm-up", prompt_ids=prompt_ids, n=n,
                                        stop=StopConditions(max_new_tokens=4, ignore_eos=True))
            self._scheduler.add(RequestState(request, self._new_sequence))
            while self._scheduler.has_work:
                self.step()
        self._num_sampled = 0  # warm-up tokens are not traffic
        self._loaded.runner.clear_prefix_cache()
        self._scheduler.space.release()  # traffic's KV grows from a small slab

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self._scheduler.add(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def step(self) -> int:
        """One engine step: schedule, run the model once, sample and emit. Returns the batch size."""
        self._drop_cancelled()
        self._expire_overdue()
        plan = self._scheduler.schedule()
        if not plan.is_empty:
            self._run(plan)
        return len(plan.decode)

    def _run(self, plan: StepPlan) -> None:
        try:
            self._postprocess(self._loaded.runner.run(plan))
        except Exception as error:  # the batch's requests end with an error event; the engine goes on
            log.exception("engine step failed")
            for sequence in self._scheduler.running_sequences():
                if sequence.finish_reason is None:
                    self._finish(sequence, FinishReason.ERROR, error=f"model step failed: {type(error).__name__}")

    def _postprocess(self, output: StepOutput) -> None:
        prompt_logprobs.record(output.prompt_logits, self._vocab.special_token_ids)  # before the first events
        sequences, logits = self._fork_completed_prompts(output)
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
            self._emit(sequence, result, row)

    def _sample_one_by_one(self, sequences: list[Sequence], logits) -> None:
        for row, sequence in enumerate(sequences):
            try:
                result = sample(logits[row:row + 1].clone(), [sequence.row])
            except Exception as error:
                self._finish(sequence, FinishReason.ERROR, error=f"sampling failed: {type(error).__name__}")
                continue
            self._emit(sequence, result, 0)

    def _emit(self, sequence: Sequence, result: SampleResult, row: int) -> None:
        if row in result.bad_rows:
            self._finish(sequence, FinishReason.ERROR, error="the model produced non-finite logits")
        elif row in result.blocked_rows:
            self._finish(sequence, FinishReason.ERROR, error="the output grammar allows no further token")
        else:
            self._append(sequence, result, row)

    def _fork_completed_prompts(self, output: StepOutput) -> tuple[list[Sequence], object]:
        """A request with n > 1 prefilled its prompt once; its other choices start from a copy of that cache."""
        sequences, rows = [], []
        for row, sequence in enumerate(output.sequences):
            choices = [sequence]
            if not sequence.output_ids and sequence.index == 0 and sequence.request.n > 1:
                forks = [self._fork(sequence, i) for i in range(1, sequence.request.n)]
                choices += [child for child in forks if child is not None]
            sequences += choices
            rows += [row] * len(choices)
        return sequences, output.logits[rows] if len(rows) != len(output.sequences) else output.logits

    def _fork(self, parent: Sequence, index: int) -> Sequence | None:
        """Choice ``index`` from a copy of the parent's prompt cache; None when memory made it wait (preempted: it
        computes the prompt itself when it resumes)."""
        child = parent.request.new_sequence(index)
        if not self._scheduler.place_fork(child, parent):
            return None
        child.num_cached = parent.num_cached
        self._scheduler.space.copy(parent, child, parent.num_cached)
        return child

    def _append(self, sequence: Sequence, result: SampleResult, row: int) -> None:
        self._num_sampled += 1
        top = tuple(TopLogprob(t, lp) for t, lp in result.top_logprobs[row])
        accepted = sequence.accept(result.token_ids[row], result.logprobs[row], top)
        if accepted.finish_reason is None:
            sequence.request.events.put(accepted.event)
        else:
            self._finish(sequence, accepted.finish_reason, event=accepted.event, error=accepted.error)

    def _finish(self, sequence: Sequence, reason: FinishReason, *, event: TokenEvent | None = None,
                error: str | None = None, error_kind: ErrorKind = ErrorKind.MODEL) -> None:
        sequence.finish_reason = reason
        self._scheduler.remove(sequence)
        base = event or TokenEvent(index=sequence.index, token_id=None, text="")
        sequence.request.events.put(dataclasses.replace(
            base, finish_reason=reason, error=error, error_kind=error_kind if error else None,
            num_prompt_tokens=sequence.num_prompt_tokens,
            num_generated_tokens=len(sequence.output_ids)))

    def _drop_cancelled(self) -> None:
        for state in self._scheduler.take_cancelled_waiting():
            state.finish_unstarted(FinishReason.ABORT)
        for sequence in self._scheduler.running_sequences():
            if sequence.request.cancelled.is_set():
                self._finish(sequence, FinishReason.ABORT)

    def _expire_overdue(self) -> None:
        """End every request past its deadline, waiting or running (``RequestState.end_overdue``)."""
        for state in self._admission.take_overdue(self._scheduler):
            state.end_overdue(self._finish, self._admission.timeout_error())

    def _end_all(self, message: str) -> None:
        """End every request, waiting or running, with an error event (the engine is stopping)."""
        for state in self._scheduler.take_waiting() + self._scheduler.running_requests():
            self._end(state, message, ErrorKind.STOPPED)

    def _end(self, state: RequestState, message: str, kind: ErrorKind) -> None:
        state.is_expired = True
        for sequence in list(state.sequences):
            if sequence.finish_reason is None:
                self._finish(sequence, FinishReason.ERROR, error=message, error_kind=kind)
        state.finish_unstarted(FinishReason.ERROR, message, kind)  # choices not forked yet, or never admitted

    def _report(self, batch_size: int) -> None:
        """Tell the listener after each step, and once when the numbers settle (so gauges reach zero)."""
        if self._listener is None:
            return
        stats = self._stats(batch_size)
        if batch_size == 0 and stats == self._last_stats:
            return
        self._num_sampled = 0
        self._reported = (getattr(self._loaded.runner, "num_prefix_queries", 0),
                          getattr(self._loaded.runner, "num_prefix_hits", 0), self._scheduler.num_preemptions)
        self._last_stats = stats
        try:
            self._listener(stats)
        except Exception:  # metrics must never stop the engine
            log.exception("engine stats listener failed")

    def _stats(self, batch_size: int) -> EngineStats:
        runner, space = self._loaded.runner, self._scheduler.space
        queries, hits = getattr(runner, "num_prefix_queries", 0), getattr(runner, "num_prefix_hits", 0)
        preemptions = self._scheduler.num_preemptions
        stats = EngineStats(
            num_running=len(self._scheduler.running_requests()),
            num_waiting=self._scheduler.num_waiting + self._inbox.qsize(),
            batch_size=batch_size, num_sampled=self._num_sampled,
            kv_cache_used_bytes=getattr(space, "bytes_per_token", 0) * self._scheduler.num_cached_tokens,
            kv_cache_allocated_bytes=getattr(space, "num_bytes", 0),
            kv_cache_budget_bytes=getattr(space, "budget", 0),
            prefix_cache_queries=queries - self._reported[0], prefix_cache_hits=hits - self._reported[1],
            num_preemptions=preemptions - self._reported[2])
        return stats

    def _new_sequence(self, state: RequestState, index: int) -> Sequence:
        return Sequence.create(state, index, self._vocab, self.limits.max_model_len)


def wait_until_ready(engine: Engine, timeout: float) -> None:
    """Block until the engine is ready; raise ``EngineError`` naming the load failure if it is not."""
    deadline = time.monotonic() + timeout
    while not engine.wait_ready(0.1):
        if engine.load_error or not engine.is_alive or time.monotonic() > deadline:
            raise EngineError(f"model failed to load: {engine.load_error or 'timed out'}")
