"""The vLLM backend: vLLM's async engine (``AsyncLLM``, in this process) behind ``backend.EngineBackend``.

Selected by ``option.rolling_batch=vllm`` (or ``auto`` with vLLM installed on CUDA) in ``loader.create_backend``;
only then is this package, and vLLM with it, imported. vLLM runs its engine core (and, with tensor or pipeline
parallelism, its workers) in processes of its own; this process keeps one thread running an asyncio loop that owns
the ``AsyncLLM``. Callers on the server's threads ``submit`` and read events from a queue, as with the lean engine.

This module is the backend's life and its loop: start, warm-up, intake, the watcher, shutdown. Which requests hold
slots and how one ends early is ``flight``'s; what the listener is told, ``stats``'; what a choice becomes in vLLM and
back, ``requests``'; what vLLM is asked, ``args``'. The meanings are the lean engine's, and so are the shared pieces:
``core.request`` (each choice accepts its tokens itself) and ``core.admission`` (429 at submit past
``Admission.max_waiting`` waiting requests; the deadline from arrival). A request waits until it is among the first
``max_running`` choices in flight (``VllmRequestState``). A watcher on the loop ends cancelled requests
(``FinishReason.ABORT``) and overdue ones (``RequestState.end_overdue``) every ``_WATCH_S``, aborting them in vLLM,
and reports the stats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from handler import threads
from handler.engine.backend import Admission, EngineLimits, EngineStats
from handler.engine.core.admission import AdmissionControl
from handler.engine.core.checks import check_request, fit_prompt
from handler.engine.core.embedding import EmbeddingJob, ScoreJob, check_inputs
from handler.engine.core.request import RequestHandle, RequestState, Sequence, Vocabulary
from handler.engine.types import (
    EmbeddingRequest,
    GenerationRequest,
    ScoreRequest,
)
from handler.engine.vllm import pooling
from handler.engine.vllm.adapters import VllmAdapters
from handler.engine.vllm.args import check_backend
from handler.engine.vllm.beams import check_beams
from handler.engine.vllm.flight import InFlight
from handler.engine.vllm.requests import VllmRequestState, check_grammar
from handler.engine.vllm.stats import StatsReport, stat_logger
from handler.errors import BadRequest, NotFound, NotReady, Unprocessable

log = logging.getLogger(__name__)

_WATCH_S = 0.05        # how often cancellations and deadlines are checked (the lean engine: every step)
_STOP_WAIT_S = 10.0


@dataclasses.dataclass(slots=True)
class Prepared:
    """What the service's preparation gives the backend: the engine arguments, the model's vocabulary, and for a
    cross-encoder the activation of its scores."""

    engine_kwargs: dict
    vocabulary: Vocabulary
    activation: str | None = None


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
        self._on_ready, self._on_failed = on_ready, on_failed
        self.load_error: str | None = None
        self._thread = threading.Thread(target=self._main, name="vllm-loop", daemon=True)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine = None            # vllm.v1.engine.async_llm.AsyncLLM
        self._vocab: Vocabulary | None = None
        self._vocab_size = 0
        self._flight = InFlight(limits, self._admission, self._stopping)  # loop thread only: requests and slots
        self._stats = StatsReport(on_stats)         # vLLM's scheduler figures and ours, to the listener
        self._embeds_only = False      # an encoder on vLLM's pooling runner
        self._activation: str | None = None   # a cross-encoder's (``core.scoring``), on the same runner
        self._ids = itertools.count()
        self._adapters: VllmAdapters | None = None  # option.enable_lora (``set_adapters``)

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
        self._check_ready()
        if self._embeds_only:
            raise BadRequest("this model is an encoder: it serves embeddings only (POST /v1/embeddings)",
                             param=request.prompt_param)
        check_backend(request)
        request = fit_prompt(request, self.limits)
        check_request(request, self.limits, self._vocab_size)
        if request.grammar is not None:
            check_grammar(request)
        if request.beam is not None:
            check_beams(request, self._vocab.eos_token_ids, self._engine.model_config.max_logprobs)
        state = VllmRequestState(request, self._new_sequence, deadline=self._admission.deadline(request.arrived_at),
                                 adapter=self._resolve_adapter(request))
        self._admission.enqueue(state, lambda s: self._loop.call_soon_threadsafe(self._flight.begin, s))
        return RequestHandle(state, lambda: self.is_alive)

    def end_session(self, session_id: str) -> None:
        """Stateful sessions are the front door's bookkeeping here: vLLM's prefix cache has no pins to let go."""
        return None

    def enable_adapters(self, max_rank: int, model_dir: Path) -> None:
        """Serve LoRA adapters (option.enable_lora; vLLM was started with ``enable_lora``)."""
        self._adapters = VllmAdapters(lambda: self._engine, lambda: self._loop, max_rank, model_dir)

    @property
    def adapters(self) -> VllmAdapters | None:
        return self._adapters if self.is_ready else None

    def _resolve_adapter(self, request: GenerationRequest) -> object | None:
        if request.adapter is None:  # with adapters on, the base model runs under an adapter of no weights
            return None if self._adapters is None else self._adapters.base_request()
        if self._adapters is None:
            raise NotFound(f"The adapter {request.adapter} was not found: this server serves no adapters "
                           "(option.enable_lora=true serves them)", param=request.adapter_param,
                           code="adapter_not_found")
        if request.beam is not None:
            raise BadRequest("beam search with a LoRA adapter is not served on vLLM here", param=request.adapter_param)
        return self._adapters.resolve(request.adapter, request.adapter_param)

    def _check_ready(self) -> None:
        if not self.is_ready or self._stopping.is_set():
            raise NotReady("the server is stopping" if self._stopping.is_set() else "the model is not ready yet")

    @property
    def embeds_only(self) -> bool:
        """An encoder: vLLM's pooling runner serves it, for embeddings only."""
        return self._embeds_only

    @property
    def score_type(self) -> str | None:
        """``cross-encoder`` on vLLM's classify task, ``bi-encoder`` for an encoder embedding, else None."""
        return "cross-encoder" if self._activation is not None else "bi-encoder" if self._embeds_only else None

    def embed(self, request: EmbeddingRequest) -> EmbeddingJob:
        """Inputs to embed, on vLLM's pooling runner (an encoder's engine). A generating engine does not embed: vLLM
        embeds with an engine of its own."""
        if not self._embeds_only:
            reason = ("this model is a cross-encoder: it scores pairs (POST /rerank, /score), and has no embeddings"
                      if self._activation is not None else
                      "embeddings are not served on the vLLM backend for a generating model (vLLM embeds with an "
                      "engine of its own, its pooling runner); serve the model with option.rolling_batch=auto or lean")
            raise Unprocessable(reason, param=request.param)
        self._check_ready()
        check_inputs(request, self.limits.max_model_len, self._vocab_size)
        job = EmbeddingJob(request, self._admission.deadline(request.arrived_at), lambda: self.is_alive,
                           self._admission.timeout_error)
        asyncio.run_coroutine_threadsafe(pooling.embed(self._engine, job, self._ids), self._loop)
        return job

    def score(self, request: ScoreRequest) -> ScoreJob:
        """Pairs for a cross-encoder, on vLLM's classify task; the logits through our activation."""
        if self._activation is None:
            raise BadRequest("this model is not a cross-encoder: it scores no pairs with a classifier head",
                             param=request.param)
        self._check_ready()
        check_inputs(request, self.limits.max_model_len, self._vocab_size)
        job = ScoreJob(request, self._admission.deadline(request.arrived_at), lambda: self.is_alive,
                       self._admission.timeout_error, activation=self._activation)
        asyncio.run_coroutine_threadsafe(pooling.score(self._engine, job, self._ids), self._loop)
        return job

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
        kwargs = dict(prepared.engine_kwargs)
        is_pooling = kwargs.get("runner") == "pooling"
        self._activation = prepared.activation if is_pooling else None
        self._embeds_only = is_pooling and self._activation is None
        if "pooler_config" in kwargs:
            from vllm.config import PoolerConfig

            kwargs["pooler_config"] = PoolerConfig(**kwargs["pooler_config"])
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs),
                                                 stat_loggers=[stat_logger(self._stats.figures)])
        self._vocab_size = self._engine.model_config.get_vocab_size()
        self._flight.run_on(self._loop, self._engine, self._vocab, self._vocab_size)
        await self._warm_up()
        log.info("vLLM ready in %.1f s (%s)", time.monotonic() - started,
                 ", ".join(f"{k}={v}" for k, v in prepared.engine_kwargs.items() if k not in ("model", "tokenizer")))

    async def _warm_up(self) -> None:
        """One short generation before /ping says ready, so the first request pays no first-call costs."""
        if self._embeds_only or self._activation is not None:  # one embedding, or one pair's score
            await pooling.warm_up(self._engine, self._activation is not None)
            return
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, detokenize=False)
        async for _ in self._engine.generate(TokensPrompt(prompt_token_ids=list(range(1, 9))), params, "warm-up"):
            pass

    async def _watch(self) -> None:
        """The lean engine's per-step checks: cancelled requests end with ABORT, overdue ones with TIMEOUT. An
        error in one turn is logged and counted (``threads``), and the next turn comes as usual."""
        while True:
            try:
                self._flight.end_cancelled_and_overdue()
                self._stats.report(self._flight)
            except Exception:
                threads.record_restart("vllm-watch")
            await asyncio.sleep(_WATCH_S)

    async def _shutdown(self, reason: str | None) -> None:
        self._flight.end_all(reason)
        await asyncio.sleep(0)  # let the cancelled choices abort their vLLM requests
        if self._engine is not None:
            await self._stop_output_handler()
            self._engine.shutdown()
        log.info("vLLM engine shut down (%s)", reason or "stopped")
        self._loop.call_soon(self._loop.stop)

    async def _stop_output_handler(self) -> None:
        """vLLM's output task, cancelled before its engine process stops: else it reads the stopped process as a
        dead engine and logs a planned shutdown as an error with a traceback."""
        handler = getattr(self._engine, "output_handler", None)
        if handler is None or handler.done():
            return
        handler.cancel()
        try:
            await handler
        except (asyncio.CancelledError, Exception):  # its cancellation, or what it ended with: stopped either way
            pass
