"""An embedding request in flight (or a cross-encoder's pairs: ``scoring``): its inputs' checks, its place in the
engine's queue, and the caller's wait. A ``ScoreJob`` is one whose inputs are pairs: queued, batched and answered the
same way, its answer the logits through the cross-encoder's activation (``scoring``), or raw when the request asks.

The engine thread takes inputs from the queued jobs in arrival order, up to a step's token budget, and runs them in
one forward (``Runner.embed``): no KV is kept, and a job answers once all its inputs are pooled. The caller's
``result`` waits for that, for the deadline (``option.request_timeout``, from arrival: 504), or for the engine's
end.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from handler.engine.types import EmbeddingRequest, Embeddings, ScoreRequest, Scores, TokenPair
from handler.errors import BadRequest, EngineError, GatewayTimeout, ServingError

_POLL_S = 0.5


def check_inputs(request: EmbeddingRequest | ScoreRequest, max_model_len: int, vocab_size: int) -> None:
    """Each input (a text's ids, or a pair's) non-empty, within the context and the vocabulary; refused naming the
    input."""
    if not request.inputs:
        raise BadRequest(f"no input to {_verb(request)}", param=request.param)
    for index, item in enumerate(request.inputs):
        ids = item.ids if isinstance(item, TokenPair) else item
        where = request.param if len(request.inputs) == 1 else f"{request.param}[{index}]"
        if not ids:
            raise BadRequest("the input is empty after tokenisation", param=where)
        if len(ids) > max_model_len:
            raise BadRequest(f"the input has {len(ids)} tokens; this model {_verb(request)}s at most {max_model_len} "
                             "(option.max_model_len)", param=where)
        if not 0 <= min(ids) <= max(ids) < vocab_size:
            raise BadRequest(f"the input has a token id outside the vocabulary (0..{vocab_size - 1})", param=where)


def _verb(request: EmbeddingRequest | ScoreRequest) -> str:
    return "score" if isinstance(request, ScoreRequest) else "embed"


@dataclass(eq=False)
class EmbeddingJob:
    """One request's inputs on the engine thread (``take``, ``put``, ``fail``) and the caller's wait (``result``).
    A cross-encoder's pairs are a ``scoring.ScoreJob``, the same way through the engine."""

    request: EmbeddingRequest | ScoreRequest
    deadline: float
    is_alive: Callable[[], bool] = lambda: True
    timeout_message: Callable[[], str] = lambda: "request timed out"
    next_input: int = 0                     # engine thread: the first input not yet taken
    vectors: list[torch.Tensor] = field(default_factory=list)
    error: ServingError | None = None
    done: threading.Event = field(default_factory=threading.Event)
    verb: ClassVar[str] = "embedded"

    @property
    def is_taken(self) -> bool:
        return self.next_input >= len(self.request.inputs)

    def take(self, budget: int) -> list[tuple[int, ...]]:
        """Inputs for a forward of at most ``budget`` tokens (at least one input)."""
        taken, tokens = [], 0
        inputs = self.request.inputs
        while self.next_input < len(inputs) and (not taken or tokens + len(inputs[self.next_input]) <= budget):
            taken.append(inputs[self.next_input])
            tokens += len(inputs[self.next_input])
            self.next_input += 1
        return taken

    def take_all(self) -> tuple[tuple[int, ...], ...]:
        """Every input at once (a backend that batches them itself)."""
        self.next_input = len(self.request.inputs)
        return self.request.inputs

    def put(self, vectors: torch.Tensor) -> None:
        self.vectors.append(vectors)
        if self.is_taken and sum(len(v) for v in self.vectors) == len(self.request.inputs):
            self.done.set()

    def fail(self, error: ServingError) -> None:
        self.error = error
        self.done.set()

    def wait(self) -> None:
        """Wait for every input's answer; raises the job's error, ``GatewayTimeout`` past the deadline,
        ``EngineError`` when the engine stopped."""
        while not self.done.wait(_POLL_S):
            if time.monotonic() > self.deadline:
                self.fail(GatewayTimeout(self.timeout_message()))  # the engine thread drops it at its next look
            elif not self.is_alive():
                self.fail(EngineError(f"the engine stopped before the input was {self.verb}"))
        if self.error is not None:
            raise self.error

    def result(self) -> Embeddings:
        """The vectors, once every input is pooled (``wait``'s errors)."""
        self.wait()
        values = torch.cat(self.vectors).tolist()
        return Embeddings(tuple(tuple(v) for v in values), sum(len(ids) for ids in self.request.inputs))


_ACTIVATIONS = {"sigmoid": torch.sigmoid, "identity": lambda logits: logits, "tanh": torch.tanh}


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """``logits``: ``[pairs]`` fp32 -> the scores (``activation``: a value of ``scoring.ACTIVATIONS``)."""
    return _ACTIVATIONS[activation](logits)


@dataclass(eq=False)
class ScoreJob(EmbeddingJob):
    """A cross-encoder's pairs on the engine thread; each forward ``put``s its logits (``[pairs]``)."""

    activation: str = "sigmoid"
    verb: ClassVar[str] = "scored"

    def result(self) -> Scores:
        """The scores, once every pair ran (``wait``'s errors)."""
        self.wait()
        logits = torch.cat(self.vectors).float().reshape(-1)
        values = logits if self.request.raw else activate(logits, self.activation)
        return Scores(tuple(values.tolist()), sum(len(pair) for pair in self.request.inputs))


def next_batch(queue: deque[EmbeddingJob], budget: int) -> tuple[list[tuple[EmbeddingJob, int]], list]:
    """The queued inputs of one forward, in arrival order, up to ``budget`` tokens: (job, how many of its inputs)
    and the inputs, of jobs of one kind (a forward embeds or scores). Jobs done while they waited (timed out or
    failed: their callers have gone on) and jobs wholly taken leave ``queue``."""
    batch: list[tuple[EmbeddingJob, int]] = []
    inputs: list = []
    while queue and budget > 0:
        job = queue[0]
        if job.done.is_set():
            queue.popleft()
            continue
        if batch and type(job) is not type(batch[0][0]):
            break
        taken = job.take(budget)  # at least one input, however long
        batch.append((job, len(taken)))
        inputs += taken
        budget -= sum(len(ids) for ids in taken)
        if not job.is_taken:
            break
        queue.popleft()
    return batch, inputs
