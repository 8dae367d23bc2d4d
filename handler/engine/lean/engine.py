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

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from handler.engine.backend import Admission, EngineLimits, EngineStats
from handler.engine.core.admission import AdmissionControl
from handler.engine.core.constraints import GrammarCompiler
from handler.engine.core.embedding import EmbeddingJob, check_inputs
from handler.engine.core.request import RequestHandle, RequestState, Vocabulary
from handler.engine.lean.speculate import Speculation
from handler.engine.lean.steps import StepLoop
from handler.engine.runners.adapters import AdapterStore
from handler.engine.runners.base import Runner
from handler.engine.types import EmbeddingRequest, GenerationRequest, Pooling
from handler.errors import BadRequest, EngineError, NotFound, NotReady, Unprocessable

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
        self._inbox: queue.SimpleQueue[RequestState | EmbeddingJob | None] = queue.SimpleQueue()
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
        self._check_ready()
        if self._loaded.path == "encoder":
            raise BadRequest(f"this model serves embeddings only (POST /v1/embeddings): {self._loaded.path_reason}",
                             param=request.prompt_param)
        request = self.fit_prompt(request)
        self.validate(request)
        adapter = self._resolve_adapter(request)
        state = RequestState(request, self._loop.new_sequence, deadline=self._admission.deadline(request.arrived_at),
                             matcher=self._compile_grammar(request), adapter=adapter)
        self._admission.enqueue(state, self._inbox.put)
        return RequestHandle(state, self._thread.is_alive)

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
            raise NotFound(f"The adapter {request.adapter} was not found: this server serves no adapters "
                           "(option.enable_lora=true serves them)", param=request.adapter_param,
                           code="adapter_not_found")
        return store.resolve(request.adapter, request.adapter_param)

    @property
    def embeds_only(self) -> bool:
        """An encoder checkpoint: embeddings only."""
        return self._loaded is not None and self._loaded.path == "encoder"

    def _check_ready(self) -> None:
        if not self.is_ready:
            raise NotReady("the model is not ready yet" if not self._stopping.is_set() else "the server is stopping")

    def embed(self, request: EmbeddingRequest) -> EmbeddingJob:
        """Queue inputs to embed; raises ``ServingError`` when this model cannot embed them."""
        self._check_ready()
        if isinstance(self._loaded.embedding, str):
            raise BadRequest(f"this model cannot embed: {self._loaded.embedding}", param=request.param)
        check_inputs(request, self.limits.max_model_len, self._loaded.vocab_size)
        job = EmbeddingJob(request, self._admission.deadline(request.arrived_at), self._thread.is_alive,
                           self._admission.timeout_error)
        self._inbox.put(job)
        return job

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
        if request.beam is not None:
            self._check_beams(request)
        if request.speculation is not None:
            self._check_speculation(request)
        vocab = self._loaded.vocab_size if self._loaded else None
        if vocab is not None and not 0 <= min(request.prompt_ids) <= max(request.prompt_ids) < vocab:  # token prompts
            raise BadRequest(f"the prompt has a token id outside the vocabulary (0..{vocab - 1})",
                             param=request.prompt_param)
        for token_id, _bias in request.sampling.logit_bias:
            if vocab is not None and not 0 <= token_id < vocab:
                raise BadRequest(f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab - 1})",
                                 param="logit_bias")

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

    def _check_beams(self, request: GenerationRequest) -> None:
        """A beam search runs all its beams at once, each with room for the whole answer: refused when the batch
        or the KV memory could never hold them."""
        beam = request.beam
        if beam.width > self.limits.max_running:
            raise BadRequest(f"beam search with {beam.width} beams needs {beam.width} sequences at once; this server "
                             f"runs {self.limits.max_running} (option.max_rolling_batch_size)", param=beam.param)
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
            loop.warm_up(generates=loaded.path != "encoder")
            log.info("warm-up took %.1f s; ready", time.monotonic() - warm_up)
        except Exception as error:  # reported by /ping (503) and in the log; ``on_failed`` decides what follows
            self.load_error = " ".join(f"{type(error).__name__}: {error}".split())
            log.exception("model load failed")
            self._on_failed(self.load_error)
            return
        self._on_ready()
        self._ready.set()
        idle_since = time.monotonic()
        while not self._stopping.is_set():
            self._drain_inbox(block=not loop.has_work)
            batch_size = loop.step() if loop.has_work else 0
            self._report(batch_size)
            if loop.has_running:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= KV_IDLE_RELEASE_S:
                loop.scheduler.space.release()  # the prefix store stays; it is under the budget too
                idle_since = math.inf
        if self._stop_reason is not None:
            self._drain_inbox(block=False)
            loop.end_all(self._stop_reason)

    def _drain_inbox(self, block: bool) -> None:
        """Take what was submitted (``block``: waiting up to half a second for it)."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        try:
            while True:
                if item is not None:
                    self._loop.add(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _report(self, batch_size: int) -> None:
        """Tell the listener after each step, and once when the numbers settle (so gauges reach zero)."""
        if self._listener is None:
            return
        stats = self._loop.stats(batch_size, self._inbox.qsize())
        if batch_size == 0 and stats == self._last_stats:
            return
        self._loop.mark_reported()
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
