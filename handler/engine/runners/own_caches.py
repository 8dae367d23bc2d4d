"""The transformers path's KV space (``OwnCaches``): each running sequence keeps its own transformers cache, and the
space accounts what those caches may hold under the same budget as the lean engine's ``kv_space.KVSpace``.

transformers grows a sequence's cache as it computes (``DynamicCache``: a tensor per layer, concatenated a position
at a time), so the space does not allocate; it *reserves*. A sequence placed or grown to ``length`` positions
reserves ``CacheCost.bytes_for(length)``: the most its cache can hold at that length. The scheduler's calls are the
lean space's (``fits``, ``place``, ``grow``, ``free``, ``copy``), so admission waits while the budget is full, and a
decoding sequence that cannot grow preempts the newest (which recompute later), as on the lean path; reserved bytes
never pass the budget, so the caches never do.

What a sequence's cache costs is read off the model's own cache at load (``hf_cost``; ``CacheCost.between``: a fresh
cache's bytes per layer after two lengths), so each family counts as transformers stores it: keys and values of
every KV head (MLA's expanded heads, an indexer's keys), a sliding or chunked window that stops growing, recurrent
and convolution states of a fixed size (a recurrent family's whole cost), layers that share another's cache holding
nothing. What a text-only probe cannot see (mllama's
cross-attention keys and values of the images) is counted once the sequence's prefill has computed it (``settle``):
from then on it is reserved, so later admissions and growth make room for it, but that one prefill may pass the
budget by its images' states.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from handler.engine.core.request import Sequence

UNBOUNDED = 1 << 62  # the budget until the loader sets one


@dataclass(frozen=True, slots=True)
class LayerCost:
    fixed: int              # bytes whatever the length (recurrent and convolution states)
    per_position: int       # bytes each cached position adds
    window: int | None      # positions past which it stops growing (a sliding or chunked window); None: never


@dataclass(frozen=True, slots=True)
class CacheCost:
    """The bytes one sequence's transformers cache holds at a length."""

    layers: tuple[LayerCost, ...]

    @classmethod
    def between(cls, first: list[int], second: list[int], lengths: tuple[int, int],
                windows: list[int | None]) -> CacheCost:
        """From each layer's bytes at two lengths (``layer_bytes``): growth per position, and the rest fixed. A
        window already full at the first length shows as fixed bytes; one filling in between grows a little
        faster than it does, up to a window it never exceeds (an upper bound either way)."""
        positions = lengths[1] - lengths[0]
        layers = []
        for small, large, window in zip(first, second, windows, strict=True):
            per_position = -(-max(large - small, 0) // positions)
            layers.append(LayerCost(max(small - per_position * lengths[0], 0), per_position, window))
        return cls(tuple(layers))

    @classmethod
    def full_attention(cls, num_layers: int, per_position: int) -> CacheCost:
        """Every layer keeping every position (a count from the config, when the model cannot be probed)."""
        return cls((LayerCost(0, per_position, None),) * num_layers)

    @property
    def bytes_per_token(self) -> int:
        """What a position adds while no window is full: the most a position ever costs."""
        return sum(layer.per_position for layer in self.layers)

    def bytes_for(self, length: int) -> int:
        return sum(layer.fixed + layer.per_position * (length if layer.window is None else min(length, layer.window))
                   for layer in self.layers)


def layer_bytes(cache: object) -> list[int]:
    """Bytes of every tensor each layer of a transformers cache holds (keys, values, states kept in dicts); a cache
    without layers (rwkv's list of states, xlstm's ``xLSTMCache``) counts as one layer holding all its tensors."""
    if cache is None:
        return []
    layers = getattr(cache, "layers", None)
    if layers is None:
        return [tensor_bytes(cache if isinstance(cache, list | tuple | dict) else vars(cache))]
    return [tensor_bytes(vars(layer)) for layer in layers]


def tensor_bytes(value: object) -> int:
    """Bytes of the tensors in ``value``: a tensor, or lists, tuples and dicts of them (nested)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def window_of(layer: object) -> int | None:
    window = getattr(layer, "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


class OwnCaches:
    """Each running sequence's own transformers cache, under ``budget`` bytes of reservations (module doc)."""

    def __init__(self, cost: CacheCost, budget: int = UNBOUNDED) -> None:
        self.cost = cost
        self.budget = budget
        self.caches: dict[Sequence, object] = {}   # sequence -> its cache (a VLM's: its generate state)
        self.reserved: dict[Sequence, int] = {}    # sequence -> bytes its cache may hold
        self.prompt_logits: dict[Sequence, object] = {}  # a prompt computed whole, until its last chunk
        self.surplus: dict[Sequence, int] = {}     # sequence -> bytes its cache holds beyond ``cost`` (``settle``)

    @property
    def num_bytes(self) -> int:
        """Bytes reserved: what the running sequences' caches may hold now."""
        return sum(self.reserved.values())

    @property
    def bytes_per_token(self) -> int:
        return self.cost.bytes_per_token

    def bytes_for(self, length: int) -> int:
        """What one sequence of ``length`` positions takes."""
        return self.cost.bytes_for(length)

    def fits(self, length: int) -> bool:
        return self.num_bytes + self.bytes_for(length) <= self.budget

    def place(self, owner: Sequence, length: int) -> bool:
        """Reserve room for ``length`` positions; False when the budget has none."""
        return self._reserve(owner, length)

    def grow(self, owner: Sequence, length: int) -> bool:
        """Reserve room for ``length`` positions (more than it holds); False when the budget has none (it keeps
        what it had)."""
        return self._reserve(owner, length)

    def settle(self, owner: Sequence, held: int, length: int) -> None:
        """After a prefill of ``length`` positions whose cache holds ``held`` bytes: what it holds beyond the count
        is reserved with it from now on."""
        surplus = held - self.bytes_for(length)
        if surplus > self.surplus.get(owner, 0):
            self.reserved[owner] = self.reserved.get(owner, 0) + surplus - self.surplus.get(owner, 0)
            self.surplus[owner] = surplus

    def _reserve(self, owner: Sequence, length: int) -> bool:
        need = self.bytes_for(length) + self.surplus.get(owner, 0)
        held = self.reserved.get(owner, 0)
        if need > held and self.num_bytes - held + need > self.budget:
            return False
        self.reserved[owner] = max(need, held)
        return True

    def free(self, owner: Sequence) -> None:
        self.caches.pop(owner, None)
        self.reserved.pop(owner, None)
        self.prompt_logits.pop(owner, None)
        self.surplus.pop(owner, None)

    def copy(self, src: Sequence, dst: Sequence, length: int) -> None:
        """Give a forked choice (placed first, so its room is reserved) its own copy of the prompt's cache."""
        self.caches[dst] = copy.deepcopy(self.caches[src])
        if extra := self.surplus.get(src, 0) - self.surplus.get(dst, 0):  # its images' states too
            self.surplus[dst] = self.surplus.get(dst, 0) + extra
            self.reserved[dst] = self.reserved.get(dst, 0) + extra

    def release(self) -> None:
        """No sequence is running: nothing is held."""
        self.caches.clear()
        self.reserved.clear()
        self.prompt_logits.clear()
        self.surplus.clear()

    def sort_key(self, owner: Sequence) -> tuple[int, int]:
        return owner.order
