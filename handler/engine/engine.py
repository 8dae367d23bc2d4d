"""The engine: one background thread owns the model and runs ``schedule -> run -> postprocess`` steps.

Callers on any thread ``submit`` a ``GenerationRequest`` and read ``TokenEvent``s from the returned handle; they
never touch the model or wait on a lock around it. All requests in flight share each model step (continuous
batching): new requests join between steps, finished ones leave at once and free their cache slot.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from handler.engine.detokenizer import IncrementalDetokenizer
from handler.engine.runner import ModelRunner, StepOutput
from handler.engine.sampler import RowState, SampleResult, sample
from handler.engine.scheduler import Scheduler
from handler.engine.sequence import RequestHandle, RequestState, Sequence, make_generator
from handler.engine.types import FinishReason, GenerationRequest, StopConditions, TokenEvent, TopLogprob
from handler.errors import BadRequest, EngineError, NotReady

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_running: int          # sequences decoded together (option.max_rolling_batch_size)
    max_model_len: int        # prompt + completion tokens
    max_step_tokens: int      # tokens one step may process (option.max_num_batched_tokens)


@dataclass(slots=True)
class LoadedModel:
    """What the loader hands the engine thread: the runner, the tokenizer for detokenising, the EOS ids."""

    runner: ModelRunner
    tokenizer: object           # tokenizers.Tokenizer
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    vocab_size: int


class Engine:
    def __init__(self, load: Callable[[], LoadedModel], limits: EngineLimits,
                 on_ready: Callable[[], None] = lambda: None) -> None:
        self._load = load
        self._on_ready = on_ready
        self.limits = limits
        self._inbox: queue.SimpleQueue[RequestState | None] = queue.SimpleQueue()
        self._scheduler = Scheduler(limits.max_running, limits.max_step_tokens, self._cached_prefix_length)
        self._loaded: LoadedModel | None = None
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self.load_error: str | None = None

    # ---- caller side (any thread) -------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._thread.is_alive()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(None)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises ``ServingError`` for one that cannot be served."""
        if not self.is_ready:
            raise NotReady("the model is not ready yet" if not self._stopping.is_set() else "the server is stopping")
        self.validate(request)
        state = RequestState(request, self._new_sequence)
        self._inbox.put(state)
        return RequestHandle(state, lambda: self._thread.is_alive())

    def validate(self, request: GenerationRequest) -> None:
        num_prompt = len(request.prompt_ids)
        if num_prompt == 0:
            raise BadRequest("the prompt is empty after tokenisation", param="prompt")
        if num_prompt >= self.limits.max_model_len:
            raise BadRequest(f"the prompt has {num_prompt} tokens; this model's context is "
                             f"{self.limits.max_model_len} tokens (option.max_model_len), prompt and completion "
                             "together", param="messages")
        if request.n > self.limits.max_running:
            raise BadRequest(f"n={request.n} is more than the {self.limits.max_running} sequences this server "
                             "runs at once (option.max_rolling_batch_size)", param="n")
        vocab = self._loaded.vocab_size if self._loaded else None
        for token_id, _bias in request.sampling.logit_bias:
            if vocab is not None and not 0 <= token_id < vocab:
                raise BadRequest(f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab - 1})",
                                 param="logit_bias")

    # ---- engine thread ------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._loaded = self._load()
        except Exception as error:  # reported by /ping staying 503 and in the log; the process keeps serving 503s
            self.load_error = f"{type(error).__name__}: {error}"
            log.exception("model load failed")
            return
        self._warm_up()
        self._on_ready()
        self._ready.set()
        while not self._stopping.is_set():
            self._drain_inbox(block=not self._scheduler.has_work)
            if self._scheduler.has_work:
                self.step()

    def _cached_prefix_length(self, prompt_ids: list[int]) -> int:
        return self._loaded.runner.cached_prefix_length(prompt_ids)

    def _warm_up(self) -> None:
        """One generation shaped like the largest step: a full prefill chunk, then every slot decoding.

        The first request then pays no first-call costs, and the allocator already holds the largest working set.
        """
        prompt_length = min(self.limits.max_step_tokens, self.limits.max_model_len // 2, 128)
        request = GenerationRequest("warm-up", prompt_ids=tuple(range(1, prompt_length + 1)),
                                    n=self.limits.max_running, stop=StopConditions(max_new_tokens=2, ignore_eos=True))
        self._scheduler.add(RequestState(request, self._new_sequence))
        while self._scheduler.has_work:
            self.step()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self._scheduler.add(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def step(self) -> None:
        """One engine step: schedule, run the model once, sample and emit."""
        self._drop_cancelled()
        plan = self._scheduler.schedule()
        if plan.is_empty:
            return
        try:
            self._postprocess(self._loaded.runner.run(plan))
        except Exception as error:  # the batch's requests end with an error event; the engine goes on
            log.exception("engine step failed")
            for sequence in list(self._scheduler.slots):
                if sequence.finish_reason is None:
                    self._finish(sequence, FinishReason.ERROR, error=f"model step failed: {type(error).__name__}")
        if not self._scheduler.slots:
            self._loaded.runner.release()

    def _postprocess(self, output: StepOutput) -> None:
        sequences, logits = self._fork_completed_prompts(output)
        if not sequences:
            return
        result = sample(logits, [s.row for s in sequences])
        bad = set(result.bad_rows)
        for row, sequence in enumerate(sequences):
            if row in bad:
                self._finish(sequence, FinishReason.ERROR, error="the model produced non-finite logits")
            else:
                self._append(sequence, result, row)

    def _fork_completed_prompts(self, output: StepOutput) -> tuple[list[Sequence], object]:
        """A request with n > 1 prefilled its prompt once; its other choices start from a copy of that cache."""
        sequences, rows = [], []
        for row, sequence in enumerate(output.sequences):
            choices = [sequence]
            if not sequence.output_ids and sequence.index == 0 and sequence.request.request.n > 1:
                choices += [self._fork(sequence, i) for i in range(1, sequence.request.request.n)]
            sequences += choices
            rows += [row] * len(choices)
        return sequences, output.logits[rows] if len(rows) != len(output.sequences) else output.logits

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        child = parent.request.new_sequence(index)
        child.num_cached = parent.num_cached
        self._scheduler.place(child)
        self._loaded.runner.copy_slot(parent.slot, child.slot, parent.num_cached)
        return child

    def _append(self, sequence: Sequence, result: SampleResult, row: int) -> None:
        token_id = result.token_ids[row]
        sequence.output_ids.append(token_id)
        stop = sequence.request.request.stop
        is_eos = token_id in self._loaded.eos_token_ids and not stop.ignore_eos
        text, hit_stop_string = ("", False) if is_eos else sequence.detokenizer.push(token_id)
        reason = self._finish_reason(sequence, token_id, is_eos, hit_stop_string)
        if reason is not None and reason is not FinishReason.STOP:
            text += sequence.detokenizer.flush()
        top = tuple(TopLogprob(t, lp) for t, lp in result.top_logprobs[row])
        event = TokenEvent(index=sequence.index, token_id=token_id, text=text, logprob=result.logprobs[row],
                           top_logprobs=top, is_special=token_id in self._loaded.special_token_ids)
        if reason is None:
            sequence.request.events.put(event)
        else:
            self._finish(sequence, reason, event=event)

    def _finish_reason(self, sequence: Sequence, token_id: int, is_eos: bool, hit_stop: bool) -> FinishReason | None:
        if is_eos:
            return FinishReason.EOS
        if hit_stop or token_id in sequence.request.request.stop.stop_token_ids:
            return FinishReason.STOP
        if len(sequence.output_ids) >= sequence.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, sequence: Sequence, reason: FinishReason, *, event: TokenEvent | None = None,
                error: str | None = None) -> None:
        sequence.finish_reason = reason
        if sequence.slot >= 0:
            move = self._scheduler.remove(sequence)
            if move is not None:
                self._loaded.runner.move(move)
        base = event or TokenEvent(index=sequence.index, token_id=None, text="")
        sequence.request.events.put(TokenEvent(
            index=base.index, token_id=base.token_id, text=base.text, logprob=base.logprob,
            top_logprobs=base.top_logprobs, is_special=base.is_special, finish_reason=reason, error=error,
            num_prompt_tokens=sequence.num_prompt_tokens, num_generated_tokens=len(sequence.output_ids)))

    def _drop_cancelled(self) -> None:
        for state in self._scheduler.take_cancelled_waiting():
            for index in range(state.request.n):
                state.events.put(TokenEvent(index=index, token_id=None, text="", finish_reason=FinishReason.ABORT,
                                            num_prompt_tokens=len(state.request.prompt_ids)))
        for sequence in [s for s in self._scheduler.slots if s.request.cancelled.is_set()]:
            self._finish(sequence, FinishReason.ABORT)

    def _new_sequence(self, state: RequestState, index: int) -> Sequence:
        request = state.request
        room = self.limits.max_model_len - len(request.prompt_ids)
        wanted = request.stop.max_new_tokens
        row = RowState(request.sampling, list(request.prompt_ids), [], make_generator(request.sampling.seed, index),
                       request.num_top_logprobs)
        detokenizer = IncrementalDetokenizer(self._loaded.tokenizer, request.stop.stop_strings)
        return Sequence(state, index, row, detokenizer, max_new_tokens=room if wanted is None else min(wanted, room))


def wait_until_ready(engine: Engine, timeout: float) -> None:
    """Block until the engine is ready; raise ``EngineError`` naming the load failure if it is not."""
    deadline = time.monotonic() + timeout
    while not engine.wait_ready(0.1):
        if engine.load_error or not engine.is_alive or time.monotonic() > deadline:
            raise EngineError(f"model failed to load: {engine.load_error or 'timed out'}")
