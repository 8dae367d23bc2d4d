"""The lean engine: one background thread owns the model and runs its step loop (``steps``).

Callers on any thread ``submit`` a ``GenerationRequest`` and read ``TokenEvent``s from the returned handle; they
never touch the model or wait on a lock around it. All requests in flight share each model step (continuous
batching): new requests join between steps, finished ones leave at once and free their cache slot.

This module is the engine's intake and life: a request is checked and refused here, before it queues (an empty or
too long prompt, more choices than slots, token ids outside the vocabulary); the thread loads the model, warms it
up, says it is ready, and then takes queued requests between steps until it is stopped. Backpressure (the bounded
wait queue and the per-request deadline) is ``admission.AdmissionControl``'s, driven by the engine's current
``admission`` settings. The engine reports ``EngineStats`` to one listener after its steps (metrics); it imports
nothing of HTTP or Prometheus.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from handler import threads
from handler.engine.backend import Admission, EngineLimits, EngineStats
from handler.engine.core.admission import AdmissionControl
from handler.engine.core.checks import check_request, fit_prompt
from handler.engine.core.constraints import GrammarCompiler
from handler.engine.core.embedding import EmbeddingJob, ScoreJob
from handler.engine.core.request import RequestHandle, RequestState, Vocabulary
from handler.engine.core.scoring import Activation
from handler.engine.lean.pooling import PoolingIntake
from handler.engine.lean.speculate import Speculation
from handler.engine.lean.steps import EndSession, StepLoop
from handler.engine.model.support import UnsupportedModel
from handler.engine.runners.adapters import AdapterStore
from handler.engine.runners.base import Runner
from handler.engine.types import (
    EmbeddingRequest,
    ErrorKind,
    FinishReason,
    GenerationRequest,
    Pooling,
    ScoreRequest,
)
from handler.errors import BadRequest, ConfigError, EngineError, NotFound, NotReady, Unprocessable

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    """What the loader hands the engine thread: the runner, the tokenizer for detokenising, the EOS ids."""

    runner: Runner                # our model (``ModelRunner``) or the checkpoint's (``TransformersRunner``)
    tokenizer: object           # tokenizers.Tokenizer
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    vocab_size: int
    grammar: GrammarCompiler | None = None    # None: this model cannot constrain its output
    path: str = "lean"                        # which engine path runs the forward: "lean" or "transformers"
    path_reason: str = ""                     # why (option.rolling_batch, or what the lean engine lacks)
    embedding: Pooling | str = "this model does not embed"  # how its embeddings pool, or why it cannot embed
    speculation: Speculation | None = None    # speculative decoding (option.speculative_draft_model)
    scoring: Activation | None = None         # a cross-encoder: the activation of its scores (None: not one)


NO_LIMITS = Admission()
# KV slabs are given back after this long without a running sequence: allocating (zeroing) a slab costs ~0.15 s
# for 377 MB here, which every request after a short pause paid when they were freed at once
KV_IDLE_RELEASE_S = 30.0
STOP_WAIT_S = 5.0  # ``stop`` waits this long for the current step (SageMaker's 30 s after SIGTERM include it)


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
        self._inbox: queue.SimpleQueue[RequestState | EmbeddingJob | EndSession | None] = queue.SimpleQueue()
        self._loaded: LoadedModel | None = None
        self._loop: StepLoop | None = None      # the step loop, once the model is loaded (``steps``)
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._stop_reason: str | None = None
        self.load_error: str | None = None
        self.admission = admission    # replaceable while running: admission control reads it each time
        self._admission = AdmissionControl(lambda: self.admission)
        self._listener = on_stats
        self._last_stats: EngineStats | None = None
        self.pooling = PoolingIntake(lambda: self._loaded, self._check_ready, self._inbox.put, self._admission,
                                     self._thread.is_alive, limits)

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
        """Stop the engine thread after its current step, waiting up to ``STOP_WAIT_S`` for it. With ``reason``,
        every request still in flight (or submitted meanwhile) ends at once with an error event carrying it
        (``ErrorKind.STOPPED``), so each stream gets its final record; without, readers learn within a second that
        the engine is gone. A second call changes nothing."""
        if self._stopping.is_set():
            return
        self._stop_reason = reason
        self._stopping.set()
        self._inbox.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(STOP_WAIT_S)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises ``ServingError`` for one that cannot be served."""
        self._check_ready()
        if self._loaded.path == "encoder":
            raise BadRequest(f"this model serves embeddings only (POST /v1/embeddings): {self._loaded.path_reason}",
                             param=request.prompt_param)
        if self._loaded.path == "cross-encoder":
            raise BadRequest(f"this model does not generate: {self._loaded.path_reason} (POST /rerank, /score)",
                             param=request.prompt_param)
        request = fit_prompt(request, self.limits)
        self.validate(request)
        state = RequestState(request, self._loop.new_sequence, deadline=self._admission.deadline(request.arrived_at),
                             matcher=self._compile_grammar(request), adapter=self._resolve_adapter(request))
        self._admission.enqueue(state, self._inbox.put)
        return RequestHandle(state, self._thread.is_alive)

    @property
    def embeds_only(self) -> bool:  # embeddings and scores are ``pooling``'s
        return self.pooling.embeds_only

    @property
    def score_type(self) -> str | None:
        return self.pooling.score_type

    def embed(self, request: EmbeddingRequest) -> EmbeddingJob:
        return self.pooling.embed(request)

    def score(self, request: ScoreRequest) -> ScoreJob:
        return self.pooling.score(request)

    def end_session(self, session_id: str) -> None:
        """A stateful session ended: the engine thread lets go of its pinned prefix blocks before its next step."""
        self._inbox.put(EndSession(session_id))

    @property
    def adapters(self) -> AdapterStore | None:
        """The LoRA adapters once the model has loaded with option.enable_lora, else None."""
        return None if self._loaded is None else getattr(self._loaded.runner, "adapters", None)

    def _resolve_adapter(self, request: GenerationRequest) -> object | None:
        """The weights of the adapter the request names (loaded now if evicted); 404 naming it when unknown."""
        if request.adapter is None:
            return None
        store = self.adapters
        if store is None:
            raise NotFound(f"The adapter {request.adapter} was not found: this server serves no adapters (option."
                           "enable_lora=true serves them)", param=request.adapter_param, code="adapter_not_found")
        return store.resolve(request.adapter, request.adapter_param)

    def _check_ready(self) -> None:
        if not self.is_ready:
            raise NotReady("the model is not ready yet" if not self._stopping.is_set() else "the server is stopping")

    def _compile_grammar(self, request: GenerationRequest):
        if request.grammar is None:
            return None
        if self._loaded.grammar is None:
            raise Unprocessable("this model cannot constrain its output", param=request.grammar.param)
        return self._loaded.grammar.compile(request.grammar)

    def validate(self, request: GenerationRequest) -> None:
        check_request(request, self.limits, self._loaded.vocab_size if self._loaded else None)
        if request.beam is not None:
            self._check_beam_memory(request)
        if request.speculation is not None:
            self._check_speculation(request)

    def _check_speculation(self, request: GenerationRequest) -> None:
        """A request's own drafting needs the server's (option.speculative_draft_model); a confidence threshold
        needs a draft model; beams are not drafted for."""
        asked, speculation = request.speculation, self._loaded.speculation
        if speculation is None:
            raise BadRequest("this server drafts no tokens: speculative decoding is set up at start "
                             "(option.speculative_draft_model: a draft model's folder, or ngram)", param=asked.param)
        if asked.confidence is not None and speculation.kind != "draft model":
            raise BadRequest(f"assistant_confidence_threshold needs a draft model; this server drafts by "
                             f"{speculation.kind}", param=asked.param)
        if request.beam is not None:
            raise BadRequest("beam search is not drafted for; leave out num_assistant_tokens and "
                             "assistant_confidence_threshold", param=asked.param)

    def _check_beam_memory(self, request: GenerationRequest) -> None:
        """A beam search runs all its beams at once, each with room for the whole answer: refused when the KV
        memory could never hold them."""
        beam = request.beam
        space = self._loop.scheduler.space if self._loop is not None else None
        budget, per_token = getattr(space, "budget", None), getattr(space, "bytes_per_token", 0)
        room = self.limits.max_model_len - len(request.prompt_ids)
        length = len(request.prompt_ids) + min(request.stop.max_new_tokens or room, room)
        if budget and beam.width * length * per_token > budget:
            raise BadRequest(f"beam search with {beam.width} beams of up to {length} positions needs "
                             f"{beam.width * length * per_token / 2**20:.0f} MiB of KV memory; the budget is "
                             f"{budget / 2**20:.0f} MiB (lower max_tokens or the beams)", param=beam.param)

    # ---- engine thread ------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:  # a model that loads but cannot run a step fails here too, in its warm-up (``StepLoop.warm_up``)
            self._loaded = loaded = self._load()
            vocab = Vocabulary(loaded.tokenizer, loaded.eos_token_ids, loaded.special_token_ids)
            self._loop = loop = StepLoop(loaded.runner, vocab, self.limits, self._admission, loaded.embedding,
                                         loaded.speculation)
            warm_up = time.monotonic()
            loop.warm_up(generates=loaded.path not in ("encoder", "cross-encoder"))
            log.info("warm-up took %.1f s; ready", time.monotonic() - warm_up)
        except Exception as error:  # reported by /ping (503) and in the log; ``on_failed`` decides what follows
            self.load_error = " ".join(f"{type(error).__name__}: {error}".split())
            if isinstance(error, UnsupportedModel | ConfigError):  # a refusal: its one line says why
                log.error("model load failed: %s", self.load_error)
            else:
                log.exception("model load failed")
            self._on_failed(self.load_error)
            return
        loop.report.mark_reported()  # the warm-up is not traffic
        self._report(0)       # the gauges, at zero, and the KV cache's size are there before any request
        self._on_ready()
        self._ready.set()
        idle_since: float | None = time.monotonic()
        while not self._stopping.is_set():
            try:
                idle_since = self._turn(loop, idle_since)
            except Exception as error:  # outside a model step (which fails only its batch): recover, or end here
                if not self._recover(loop, error):
                    return
        if self._stop_reason is not None:
            self._drain_inbox(block=False)
            loop.end_all(self._stop_reason)
        log.info("lean engine stopped (%s)", self._stop_reason or "stopped")

    def _turn(self, loop: StepLoop, idle_since: float | None) -> float | None:
        """One turn of the engine thread: take what was submitted, step, report; when the KV space has been idle
        long enough, give its memory back. Returns since when nothing has run (None: something is running)."""
        self._drain_inbox(block=not loop.has_work)
        batch_size = loop.step() if loop.has_work else 0
        self._report(batch_size)
        if loop.has_running:
            return None
        if idle_since is None:
            return time.monotonic()
        if time.monotonic() - idle_since >= KV_IDLE_RELEASE_S:
            loop.scheduler.space.release()  # the prefix store stays; it is under the budget too
            return math.inf
        return idle_since

    def _recover(self, loop: StepLoop, error: Exception) -> bool:
        """An unexpected error in the engine's own bookkeeping: every request in flight ends with an error event
        naming it (their state cannot be trusted), and the loop starts again, counted (``threads``). False when
        even that fails: the thread ends, ``is_ready`` turns false and /ping says so."""
        threads.record_restart("engine")
        try:
            loop.end_all(f"engine error: {type(error).__name__}: {error}", ErrorKind.MODEL)
            return True
        except Exception:
            log.exception("the engine cannot recover; it stops")
            self.load_error = f"engine stopped after an error: {type(error).__name__}: {error}"
            return False

    def _drain_inbox(self, block: bool) -> None:
        """Take what was submitted (``block``: waiting up to half a second for it)."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        try:
            while True:
                if item is not None:
                    self._take(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _take(self, item: RequestState | EmbeddingJob | EndSession) -> None:
        """One submitted item into the step loop; one that cannot join fails alone, with an error event."""
        try:
            self._loop.add(item)
        except Exception as error:
            log.exception("a request could not join the engine")
            message = f"the engine could not take the request: {type(error).__name__}: {error}"
            if isinstance(item, EmbeddingJob):
                item.fail(EngineError(message))
            elif isinstance(item, RequestState):
                item.finish_unstarted(FinishReason.ERROR, message, ErrorKind.MODEL)

    def _report(self, batch_size: int) -> None:
        """Tell the listener after each step, and once when the numbers settle (so gauges reach zero)."""
        if self._listener is None:
            return
        stats = self._loop.report.stats(batch_size, self._inbox.qsize())
        if batch_size == 0 and stats == self._last_stats:
            return
        self._loop.report.mark_reported()
        self._last_stats = stats
        try:
            self._listener(stats)
        except Exception:  # metrics must never stop the engine
            log.exception("engine stats listener failed")


def wait_until_ready(engine: Engine, timeout: float) -> None:
    """Block until the engine is ready; raise ``EngineError`` naming the load failure if it is not."""
    deadline = time.monotonic() + timeout
    while not engine.wait_ready(0.1):
        if engine.load_error or not engine.is_alive or time.monotonic() > deadline:
            raise EngineError(f"model failed to load: {engine.load_error or 'timed out'}")
