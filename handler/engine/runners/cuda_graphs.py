"""CUDA graphs for the lean engine's decode steps, on a GPU: on with ``option.enforce_eager=false``. Unset, the lean
engine stays eager: these graphs were written without a GPU to run them on (no machine was lent to that work), and
``tests/integration/test_cuda_graphs.py`` (``ENGINE_TEST_DEVICE=cuda``) must pass on one before they become the
default.

Why: a small model's decode step on a GPU is bound by launching its kernels from Python, not by arithmetic
(measured on an H100 with the embedded 135M model: 16 ms a step for one row, a few hundred kernels of microseconds
each). A CUDA graph records the kernels of a step once and replays them with one launch.

What is graphed: a step in which every row decodes one token and the rows are one run of slots of one slab (the
steady state of a batch of streams). A step with prompt work, drafts to verify, rows in several slabs, or a model
whose step reads values back to the host (a mixture of experts counts its rows per expert) runs eagerly, as does
every step with LoRA adapters. A graph is recorded the first time its shape comes: the slab, the run of slots,
and the key length in whole KEY_BLOCKs (a row's attention reads whole blocks, so the length changes once every 64
positions). That first step runs eagerly on the recording stream (its result is the step's), then the same
function is recorded; later steps of the shape copy their tokens and positions into the graph's input buffer and
replay it. The masks are computed inside the graph from the positions (``layout.decode_layout``). A replay
launches the very kernels the eager step launches, on the same shapes, so its logits should be the eager step's, bit
for bit: ``tests/integration/test_cuda_graphs.py`` checks that on a GPU.

Memory: the graphs share one memory pool (replays never overlap: the engine thread runs one step at a time), so
what they hold beside their inputs is about one step's activations; every graph writes its logits into one
shared buffer. At most ``MAX_GRAPHS`` are kept, the least recently used dropped first. A graph names its slab's
tensors by address and shape: a slab that is freed and reallocated elsewhere gets new graphs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from handler.engine.model.decoder import DecoderModel
from handler.engine.model.kv_cache import whole_blocks
from handler.engine.model.layout import decode_layout
from handler.engine.model.moe import SparseMoE

log = logging.getLogger(__name__)

MAX_GRAPHS = 256


def why_eager(model: DecoderModel) -> str | None:
    """Why the model's decode step cannot be recorded (None: it can)."""
    if model.device.type != "cuda":
        return f"the model runs on {model.device.type}"
    if any(isinstance(layer.mlp, SparseMoE) for layer in model.layers):
        return "its mixture-of-experts layers read each step's routing back to the host"
    if model.adapter_batch is not None:
        return "LoRA adapters are enabled (each step's adapter rows change)"
    return None


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor      # [2, rows] long on the device: the step's tokens, then their positions


class DecodeGraphs:
    """The recorded decode steps of one model over one KV space (module doc). Engine thread only."""

    def __init__(self, model: DecoderModel, space, max_rows: int) -> None:
        self.model, self.space = model, space
        self.groups = model.shape.num_heads // model.shape.num_kv_heads
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=model.device)
        self.max_rows = max_rows
        self.logits = torch.empty(max_rows, model.shape.vocab_size, dtype=torch.float32, device=model.device)
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.num_recorded = self.num_replayed = 0
        self.disabled: str | None = None   # why recording stopped (a failure), logged once

    def run(self, handle: tuple[int, int, int, int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (fp32) of a decode step whose rows are the group ``handle``: a replay, or an
        eager step that then records its shape. A view of a shared buffer: read it before the next step."""
        rows = len(tokens)
        length = whole_blocks(max(positions) + 1)
        keys, values = self.space.storage(handle)
        key = (handle, length, keys.data_ptr(), values.data_ptr(), tuple(keys.shape))
        host = torch.tensor([tokens, positions], dtype=torch.long)
        found = self.graphs.get(key)
        if found is not None:
            found.inputs.copy_(host)
            found.graph.replay()
            self.graphs.move_to_end(key)
            self.num_replayed += 1
            return self.logits[:rows]
        inputs = host.to(self.model.device)
        step = self._step(inputs, handle, length, rows)
        # the eager step first, on the stream the graph is recorded from: the step's result, and every first-call
        # cost (cuBLAS workspaces, lazily loaded kernels) paid before recording
        self.stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(self.stream):
            step()
        torch.cuda.current_stream(self.model.device).wait_stream(self.stream)
        if self.disabled is None:
            self._record(key, step, inputs)
        return self.logits[:rows]

    def _step(self, inputs: torch.Tensor, handle: tuple, length: int, rows: int):
        model, window = self.model, self.model.spec.window

        def step() -> None:
            tokens, positions = inputs[0], inputs[1]
            layout = decode_layout(positions, handle, length, self.groups, window)
            logit_rows = torch.arange(rows, device=positions.device)
            self.logits[:rows].copy_(model.forward(tokens, positions, layout, self.space, logit_rows))
        return step

    def _record(self, key: tuple, step, inputs: torch.Tensor) -> None:
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than ``torch.cuda.graph``, which empties the allocator's cache at every
        # recording (the eager steps after it would allocate their memory from the driver again); "thread_local":
        # only this thread's calls can break the recording (a request thread's work cannot)
        try:
            with torch.cuda.stream(self.stream):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    step()
                finally:
                    graph.capture_end()
        except Exception as error:  # this model's step cannot be recorded: every step runs eagerly from now on
            self.disabled = f"{type(error).__name__}: {error}"
            log.warning("CUDA graphs off: recording a decode step failed (%s); steps run eagerly", self.disabled)
            torch.cuda.synchronize(self.model.device)
            self.graphs.clear()
            return
        self.graphs[key] = _Graph(graph, inputs)
        self.num_recorded += 1
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
