"""An embedding request in flight: its inputs' checks, its place in the engine's queue, and the caller's wait.

The engine thread takes inputs from the queued jobs in arrival order, up to a step's token budget, and runs them in
one forward (``Runner.embed``): no KV is kept, and a job answers once all its inputs are pooled. The caller's
``result`` waits for that, for the deadline (``option.request_timeout``, from arrival: 504), or for the engine's
end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from handler.engine.types import EmbeddingRequest, Embeddings
from handler.errors import BadRequest, EngineError, GatewayTimeout, ServingError

_POLL_S = 0.5


def check_inputs(request: EmbeddingRequest, max_model_len: int, vocab_size: int) -> None:
    """Each input non-empty, within the context and the vocabulary; refused naming the input."""
    if not request.inputs:
        raise BadRequest("no input to embed", param=request.param)
    for index, ids in enumerate(request.inputs):
        where = request.param if len(request.inputs) == 1 else f"{request.param}[{index}]"
        if not ids:
            raise BadRequest("the input is empty after tokenisation", param=where)
        if len(ids) > max_model_len:
            raise BadRequest(f"the input has {len(ids)} tokens; this model embeds at most {max_model_len} "
                             "(option.max_model_len)", param=where)
        if not 0 <= min(ids) <= max(ids) < vocab_size:
            raise BadRequest(f"the input has a token id outside the vocabulary (0..{vocab_size - 1})", param=where)


@dataclass(eq=False)
class EmbeddingJob:
    """One request's inputs on the engine thread (``take``, ``put``, ``fail``) and the caller's wait (``result``)."""

    request: EmbeddingRequest
    deadline: float
    is_alive: Callable[[], bool] = lambda: True
    timeout_message: Callable[[], str] = lambda: "request timed out"
    next_input: int = 0                     # engine thread: the first input not yet taken
    vectors: list[torch.Tensor] = field(default_factory=list)
    error: ServingError | None = None
    done: threading.Event = field(default_factory=threading.Event)

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

    def result(self) -> Embeddings:
        """Wait for the vectors; raises the job's error, ``GatewayTimeout`` past the deadline, ``EngineError``
        when the engine stopped."""
        while not self.done.wait(_POLL_S):
            if time.monotonic() > self.deadline:
                self.fail(GatewayTimeout(self.timeout_message()))  # the engine thread drops it at its next look
            elif not self.is_alive():
                self.fail(EngineError("the engine stopped before the input was embedded"))
        if self.error is not None:
            raise self.error
        values = torch.cat(self.vectors).tolist()
        return Embeddings(tuple(tuple(v) for v in values), sum(len(ids) for ids in self.request.inputs))
