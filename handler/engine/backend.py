"""The one interface between the server and whatever generates tokens.

A backend takes a ``GenerationRequest`` and answers with a ``GenerationHandle``: an iterator of ``TokenEvent``s that
the caller can ``cancel()``. It reports readiness (``is_ready``, ``load_error``) and, after its steps, an
``EngineStats`` to the listener it was built with. The server, the service and the formatters depend on this
module, ``types`` and ``loader`` only; which backend runs is decided once, from the settings, by
``loader.create_backend``.

Backends today: the lean continuous-batching engine (``lean/``), whose runner is either our own model code or the
checkpoint's transformers code (``lean.paths.choose_path``), and vLLM's engine (``vllm/``). Each keeps these meanings:
a request past ``Admission.max_waiting`` waiting requests is refused with ``Overloaded`` at submit; a request
unfinished ``Admission.timeout_s`` after it arrived ends its choices with what they generated
(``FinishReason.DEADLINE``) or, with none, an event whose ``error_kind`` is ``ErrorKind.TIMEOUT``; a cancelled
request ends with ``FinishReason.ABORT`` and frees its place at the next step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from handler.engine.types import (
    AdapterInfo,
    EmbeddingRequest,
    Embeddings,
    GenerationRequest,
    ScoreRequest,
    Scores,
    TokenEvent,
)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_running: int          # sequences decoded together (option.max_rolling_batch_size)
    max_model_len: int        # prompt + completion tokens
    max_step_tokens: int      # tokens one step may process (option.max_num_batched_tokens)


@dataclass(frozen=True, slots=True)
class Admission:
    """How much waiting a backend accepts (``None``: no limit)."""

    max_waiting: int | None = None     # requests without a batch slot (option.max_queue_size)
    timeout_s: float | None = None     # seconds from submit to the last event (option.request_timeout)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What a backend reports to its listener after each step, and once when it goes idle."""

    num_running: int                   # requests holding batch slots
    num_waiting: int                   # requests submitted but without a slot
    batch_size: int                    # sequences in the step just run (0: no step ran)
    num_sampled: int                   # tokens sampled since the previous report
    kv_cache_used_bytes: int           # cache positions holding tokens of running sequences
    kv_cache_allocated_bytes: int
    kv_cache_budget_bytes: int = 0     # what allocation never exceeds (0: the backend has no budget)
    prefix_cache_queries: int = 0      # prompt tokens admitted since the previous report
    prefix_cache_hits: int = 0         # of which came from a cached prefix
    num_preemptions: int = 0           # sequences preempted for memory since the previous report
    num_draft_tokens: int = 0          # speculative decoding: tokens drafted since the previous report
    num_accepted_tokens: int = 0       # of which the model's own sampling agreed with
    kv_cache_usage: float = 0.0        # share of the KV capacity running sequences hold, 0 to 1
    kv_block_size: int = 0             # tokens per KV block (the prefix cache's unit; 0: the backend has none)
    kv_num_blocks: int = 0             # blocks the KV capacity holds
    queue_times: tuple[float, ...] = ()      # seconds each request given a batch slot since the previous report
                                             # waited for it, from the backend's intake
    max_loras: int = 0                 # adapters one batch may use (option.max_loras; 0: LoRA is off)
    running_adapters: tuple[str, ...] = ()   # the LoRA adapters of the requests running now
    waiting_adapters: tuple[str, ...] = ()   # and of those waiting


class GenerationHandle(Protocol):
    """A submitted request: iterate it for its events (each choice ends with one that has a finish reason)."""

    @property
    def request(self) -> GenerationRequest: ...

    def cancel(self) -> None: ...

    def __iter__(self) -> Iterator[TokenEvent]: ...


class EmbeddingHandle(Protocol):
    """Submitted inputs to embed: ``result`` waits for them (``ServingError`` when they failed or time ran out)."""

    def result(self) -> Embeddings: ...


class ScoreHandle(Protocol):
    """Submitted pairs to score: ``result`` waits for them (``ServingError`` when they failed or time ran out)."""

    def result(self) -> Scores: ...


class AdapterManager(Protocol):
    """A backend's LoRA adapters (option.enable_lora): registered by name from a folder, at most option.max_loras
    loaded at once, the least recently used unpinned one evicted for another. Errors are ``ServingError``s naming
    the field: 404 for an unknown name, 400 for a folder that is no adapter of this model, 409 for a taken name."""

    def register(self, name: str, src: str, *, preload: bool = True, pin: bool = False,
                 folder: Path | None = None) -> AdapterInfo:
        """``folder``: where ``src``'s files are on this machine (an ``s3://`` src downloaded); unset: ``src``."""
        ...

    def unregister(self, name: str) -> None: ...

    def list(self) -> list[AdapterInfo]: ...

    def drain_events(self) -> list[tuple[str, str]]:
        """``(event, adapter)`` since the last call, event ``loaded`` or ``evicted`` (for metrics)."""
        ...


class EngineBackend(Protocol):
    """What the service starts and the server submits to."""

    limits: EngineLimits
    load_error: str | None            # why loading failed (then it never becomes ready)

    @property
    def is_ready(self) -> bool: ...

    @property
    def is_alive(self) -> bool: ...

    @property
    def adapters(self) -> AdapterManager | None:
        """The LoRA adapters, or None when this backend serves none (option.enable_lora off, or not loaded)."""
        ...

    def start(self) -> None: ...

    def stop(self, reason: str | None = None) -> None:
        """Stop; with ``reason``, every request in flight ends at once with an ``ErrorKind.STOPPED`` event."""
        ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        """Queue a request; raises a ``ServingError`` (naming the field) for one that cannot be served."""
        ...

    def end_session(self, session_id: str) -> None:
        """A stateful session (``GenerationRequest.session``) was closed: what the backend keeps for it goes."""
        ...

    @property
    def embeds_only(self) -> bool:
        """The model serves embeddings only (an encoder): generation is refused."""
        ...

    def embed(self, request: EmbeddingRequest) -> EmbeddingHandle:
        """Queue inputs to embed; raises a ``ServingError`` for inputs (or a model) that cannot be embedded."""
        ...

    @property
    def score_type(self) -> str | None:
        """How the model scores a pair of texts (rerank, score): ``cross-encoder`` (``score``), ``bi-encoder`` (the
        cosine of two ``embed`` vectors), or None (a generating model: refused)."""
        ...

    def score(self, request: ScoreRequest) -> ScoreHandle:
        """Queue pairs for a cross-encoder; raises a ``ServingError`` for pairs (or a model) that cannot be scored."""
        ...
