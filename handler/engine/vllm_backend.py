"""The vLLM backend: vLLM's async engine (``AsyncLLM``, in this process) behind ``backend.EngineBackend``.

Selected by ``option.rolling_batch=vllm`` (or ``auto`` with vLLM installed on CUDA) in ``service.create_backend``;
only then is this module, and vLLM with it, imported. vLLM runs its engine core (and, with tensor or pipeline
parallelism, its workers) in processes of its own; this process keeps one thread running an asyncio loop that owns
the ``AsyncLLM``. Callers on the server's threads ``submit`` and read events from a queue, as with the lean engine.

The meanings are the lean engine's, and so are most of the pieces: ``sequence.RequestState`` / ``Sequence`` /
``RequestHandle`` (each choice accepts its tokens itself: EOS, stop token ids, stop strings held back across
tokens, special tokens, max_new_tokens), ``admission.AdmissionControl`` (429 at submit past
``Admission.max_waiting`` waiting requests; the deadline from arrival). vLLM samples; what it is asked is
``vllm_args``'s mapping. A request waits until it is among the first ``max_running`` choices in flight
(``VllmRequestState``). A watcher on the loop ends cancelled requests (``FinishReason.ABORT``) and overdue ones
(``ErrorKind.TIMEOUT``) every ``_WATCH_S``, aborting them in vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable

from handler.engine.admission import AdmissionControl
from handler.engine.backend import Admission, EngineLimits, EngineStats
from handler.engine.sequence import RequestHandle, RequestState, Sequence, Vocabulary
from handler.engine.types import (
    ErrorKind,
    FinishReason,
    GenerationRequest,
    PromptLogprob,
    TokenEvent,
    TopLogprob,
)
from handler.engine.vllm_args import check_request, fit_prompt, grammar_source, prompt_inputs, sampling_kwargs
from handler.errors import BadRequest, NotReady

log = logging.getLogger(__name__)

_WATCH_S = 0.05        # how often cancellations and deadlines are checked (the lean engine: every step)
_STOP_WAIT_S = 10.0


@dataclasses.dataclass(slots=True, eq=False)
class VllmRequestState(RequestState):
    """A request on vLLM. It waits until it is among the first ``max_running`` choices in flight, in arrival order:
    vLLM's scheduler admits requests first come, first served up to ``max_num_seqs``, so those hold batch slots
    (prefilling or decoding) and the rest wait in its queue. (The first token is a later sign: a long prefill would
    count as waiting.)"""

    has_slot: bool = False

    @property
    def is_waiting(self) -> bool:
        return not self.has_slot and not self.is_expired and not self.cancelled.is_set()


@dataclasses.dataclass(slots=True)
class Prepared:
    """What the service's preparation gives the backend: the engine arguments and the model's vocabulary."""

    engine_kwargs: dict
    vocabulary: Vocabulary


class VllmBackend:
    """``backend.EngineBackend`` over vLLM. ``prepare`` runs on the backend's thread before vLLM starts (it loads
    the tokenizer the prompt layer renders with) and returns the engine arguments and the vocabulary."""

    def __init__(self, prepare: Callable[[], Prepared], limits: EngineLimits, admission: Admission,
                 on_stats: Callable[[EngineStats], None] | None = None,
                 on_ready: Callable[[], None] = lambda: None,
                 on_failed: Callable[[str], None] = lambda reason: None) -> None:
        self._prepare = prepare
        self.limits = limits
        self.admission = admission
        self._admission = AdmissionControl(lambda: self.admission)
        self._on_stats, self._on_ready, self._on_failed = on_stats, on_ready, on_failed
        self.load_error: str | None = None
        self._thread = threading.Thread(target=self._main, name="vllm-loop", daemon=True)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine = None            # vllm.v1.engine.async_llm.AsyncLLM
        self._vocab: Vocabulary | None = None
        self._vocab_size = 0
        self._live: dict[VllmRequestState, list[asyncio.Task]] = {}   # loop thread only, in arrival order
        self._ids = itertools.count()
        self._num_sampled = 0
        self._last_stats: EngineStats | None = None

    # ---- caller side (any thread) -------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.is_alive

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not (self._engine is not None and self._engine.errored)

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def stop(self, reason: str | None = None) -> None:
        """End every request in flight (with ``reason``: an ``ErrorKind.STOPPED`` event each), then shut vLLM down."""
        self._stopping.set()
        if self._loop is None or not self._thread.is_alive():
            return
        done = asyncio.run_coroutine_threadsafe(self._shutdown(reason), self._loop)
        try:
            done.result(_STOP_WAIT_S)
        except Exception:  # shutting down: nothing is left to tell
            log.exception("vLLM shutdown failed")

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises ``ServingError`` (naming the field) for one that cannot be served."""
        if not self.is_ready or self._stopping.is_set():
            raise NotReady("the server is stopping" if self._stopping.is_set() else "the model is not ready yet")
        request = fit_prompt(request, self.limits)
        check_request(request, self.limits, self._vocab_size)
        if request.grammar is not None:
            self._check_grammar(request)
        state = VllmRequestState(request, self._new_sequence, deadline=self._admission.deadline(request.arrived_at))
        self._admission.enqueue(state, lambda s: self._loop.call_soon_threadsafe(self._begin, s))
        return RequestHandle(state, lambda: self.is_alive)

    @staticmethod
    def _check_grammar(request: GenerationRequest) -> None:
        """A grammar llguidance refuses is a 400 at submit, as on the lean engine (vLLM would fail it later)."""
        import llguidance

        spec = request.grammar
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar_source(spec), None)
        except (ValueError, TypeError) as exc:
            error = str(exc)
        if error:
            raise BadRequest(f"{spec.param} cannot be compiled: {error}", param=spec.param)

    def _new_sequence(self, state: RequestState, index: int) -> Sequence:
        return Sequence.create(state, index, self._vocab, self.limits.max_model_len)

    # ---- the loop thread -----------------------------------------------------------------------------------
    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._load())
        except Exception as error:  # reported by /ping (503) and the log; ``on_failed`` decides what follows
            self.load_error = f"{type(error).__name__}: {error}"
            log.exception("vLLM failed to start")
            self._on_failed(self.load_error)
            return
        watcher = self._loop.create_task(self._watch())
        self._on_ready()
        self._ready.set()
        self._loop.run_forever()
        watcher.cancel()

    async def _load(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        prepared = self._prepare()
        self._vocab = prepared.vocabulary
        started = time.monotonic()
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**prepared.engine_kwargs))
        self._vocab_size = self._engine.model_config.get_vocab_size()
        await self._warm_up()
        log.info("vLLM ready in %.1f s (%s)", time.monotonic() - started,
                 ", ".join(f"{k}={v}" for k, v in prepared.engine_kwargs.items() if k not in ("model", "tokenizer")))

    async def _warm_up(self) -> None:
        """One short generation before /ping says ready, so the first request pays no first-call costs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, detokenize=False)
        async for _ in self._engine.generate(TokensPrompt(prompt_token_ids=list(range(1, 9))), params, "warm-up"):
            pass

    def _begin(self, state: RequestState) -> None:
        if state.cancelled.is_set() or self._stopping.is_set():
            state.finish_unstarted(FinishReason.ABORT)
            return
        self._live[state] = [self._loop.create_task(self._run_choice(state, i)) for i in range(state.n)]
        self._grant_slots()

    def _grant_slots(self) -> None:
        """Mark the requests vLLM has room for (first come, first served up to ``max_running`` choices)."""
        free = self.limits.max_running
        for state in self._live:
            if free < state.n:
                return
            free -= state.n
            state.has_slot = True

    async def _run_choice(self, state: RequestState, index: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        request = state.request
        kwargs = sampling_kwargs(request, index, self.limits.max_model_len, self._vocab.eos_token_ids)
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
        outputs = self._engine.generate(TokensPrompt(**prompt_inputs(request)), params,
                                        f"{request.request_id}-{index}-{next(self._ids)}")
        sequence = None
        try:
            async for output in outputs:
                if sequence is None:  # vLLM scheduled and prefilled it: it no longer waits
                    sequence = state.new_sequence(index)
                if self._accept(sequence, output):
                    return
        except asyncio.CancelledError:  # cancelled, overdue or stopping: whoever cancelled sends the final event
            raise
        except Exception as error:  # this choice fails; the engine and other requests go on
            log.exception("vLLM request %s failed", request.request_id)
            if sequence is None:
                sequence = state.new_sequence(index)
            self._finish(sequence, FinishReason.ERROR, error=f"model step failed: {type(error).__name__}: {error}")
        finally:
            await outputs.aclose()  # a choice that ended here (stop string) is aborted in vLLM
            self._forget(state)

    def _accept(self, sequence: Sequence, output) -> bool:
        """Feed one vLLM output's new tokens to the sequence and send their events; True when the choice ended."""
        completion = output.outputs[0]
        first = not sequence.output_ids
        for position, token_id in enumerate(completion.token_ids):
            logprob, top = _logprobs(completion.logprobs, position, token_id, sequence.request.request.num_top_logprobs)
            accepted = sequence.accept(token_id, logprob, top)
            self._num_sampled += 1
            event = accepted.event
            if first and output.prompt_logprobs is not None:
                event = dataclasses.replace(event, prompt_logprobs=_prompt_logprobs(
                    output.prompt_token_ids, output.prompt_logprobs, sequence.request.request.prompt_logprobs or 0,
                    self._vocab.special_token_ids))
            first = False
            if accepted.finish_reason is not None:
                self._finish(sequence, accepted.finish_reason, event=event, error=accepted.error)
                return True
            sequence.request.events.put(event)
        if completion.finish_reason is None:
            return False
        # vLLM ended it where our checks did not: the context is full, or it aborted / failed the request
        reason = {"length": FinishReason.LENGTH, "abort": FinishReason.ABORT}.get(completion.finish_reason)
        tail = TokenEvent(index=sequence.index, token_id=None, text=sequence.detokenizer.flush())
        error = None if reason else f"vLLM ended the request: {completion.finish_reason}"
        self._finish(sequence, reason or FinishReason.ERROR, event=tail, error=error)
        return True

    def _finish(self, sequence: Sequence, reason: FinishReason, *, event: TokenEvent | None = None,
                error: str | None = None, error_kind: ErrorKind = ErrorKind.MODEL) -> None:
        sequence.finish_reason = reason
        base = event or TokenEvent(index=sequence.index, token_id=None, text="")
        sequence.request.events.put(dataclasses.replace(
            base, finish_reason=reason, error=error, error_kind=error_kind if error else None,
            num_prompt_tokens=sequence.num_prompt_tokens, num_generated_tokens=len(sequence.output_ids)))

    def _forget(self, state: RequestState) -> None:
        tasks = self._live.get(state)
        if tasks is not None and all(t.done() or t is asyncio.current_task() for t in tasks):
            del self._live[state]
            self._grant_slots()

    def _end(self, state: RequestState, reason: FinishReason, message: str | None, kind: ErrorKind | None) -> None:
        """End every unfinished choice of ``state`` now (cancelled, overdue, stopping) and abort it in vLLM."""
        state.is_expired = reason is FinishReason.ERROR
        for task in self._live.pop(state, []):
            task.cancel()
        self._grant_slots()
        if kind is ErrorKind.TIMEOUT:
            state.end_overdue(self._finish, message)
            return
        for sequence in state.sequences:
            if sequence.finish_reason is None:
                self._finish(sequence, reason, error=message, error_kind=kind or ErrorKind.MODEL)
        state.finish_unstarted(reason, message, kind)

    async def _watch(self) -> None:
        """The lean engine's per-step checks: cancelled requests end with ABORT, overdue ones with TIMEOUT."""
        while True:
            now = time.monotonic()
            for state in list(self._live):
                if state.cancelled.is_set():
                    self._end(state, FinishReason.ABORT, None, None)
                elif state.deadline <= now:
                    self._end(state, FinishReason.ERROR, self._admission.timeout_error(), ErrorKind.TIMEOUT)
            self._report()
            await asyncio.sleep(_WATCH_S)

    async def _shutdown(self, reason: str | None) -> None:
        for state in list(self._live):
            if reason is not None:
                self._end(state, FinishReason.ERROR, reason, ErrorKind.STOPPED)
            else:
                self._end(state, FinishReason.ABORT, None, None)
        await asyncio.sleep(0)  # let the cancelled choices abort their vLLM requests
        if self._engine is not None:
            self._engine.shutdown()
        self._loop.call_soon(self._loop.stop)

    def _report(self) -> None:
        if self._on_stats is None:
            return
        running = [s for s in self._live if s.has_slot]
        stats = EngineStats(num_running=len(running), num_waiting=len(self._live) - len(running),
                            batch_size=sum(1 for s in running for q in s.sequences if q.finish_reason is None),
                            num_sampled=self._num_sampled, kv_cache_used_bytes=0, kv_cache_allocated_bytes=0)
        if stats.num_sampled == 0 and stats == self._last_stats:
            return
        self._num_sampled, self._last_stats = 0, stats
        try:
            self._on_stats(stats)
        except Exception:  # metrics must never stop the engine
            log.exception("engine stats listener failed")


def _logprobs(positions, position: int, token_id: int, num_top: int) -> tuple[float, tuple[TopLogprob, ...]]:
    """The chosen token's logprob and the ``num_top`` most likely tokens from vLLM's per-position dicts
    (``{token_id: Logprob(logprob, rank, ...)}``: the chosen token and the top ones, ranks from 1)."""
    if not positions or position >= len(positions) or positions[position] is None:
        return 0.0, ()
    entries = positions[position]
    chosen = entries[token_id].logprob if token_id in entries else 0.0
    if num_top <= 0:
        return chosen, ()
    top = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank is not None and e.rank <= num_top)
    return chosen, tuple(TopLogprob(t, lp) for _rank, t, lp in top)


def _prompt_logprobs(prompt_ids, positions, num_top: int, special_ids) -> tuple[PromptLogprob, ...]:
    """vLLM's prompt logprobs (None first, then per prompt token a dict of it and the ``num_top`` most likely) as
    ``PromptLogprob``s."""
    result = []
    for token_id, entries in zip(prompt_ids, positions, strict=True):
        is_special = token_id in special_ids
        if not entries:
            result.append(PromptLogprob(token_id, None, is_special=is_special))
            continue
        own = entries[token_id]
        top = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank is not None and e.rank <= num_top)
        result.append(PromptLogprob(token_id, own.logprob, own.rank, tuple(TopLogprob(t, lp) for _r, t, lp in top),
                                    is_special))
    return tuple(result)
