"""The model's KV memory in its simplest form: dense slot tensors (``KVCache``), one per K and V, ``[layers, slots,
kv_heads, capacity, head_dim]``. A decode step reads a run of its slots as one batch, which is what makes decode
attention cheap on a CPU (one matmul per layer for the whole batch, no gather). The engine's budgeted space of them
is ``runners.kv_space.KVSpace``.
"""

from __future__ import annotations

import torch

from handler.engine.model.kernels import int8_kernel

MIN_SLOTS = 4
_MIN_LENGTH = 256
# Attention reads keys in whole blocks of this many positions (``layout.build_layout``), so capacity is a multiple
KEY_BLOCK = 64
# decode views kept (``KVCache.decode_view``): a step of L layers reads L per decode group, the same ones until a
# group's keys pass a KEY_BLOCK; past this many they are all dropped and made again
_MAX_VIEWS = 4096


def whole_blocks(length: int) -> int:
    """``length`` rounded up to a multiple of KEY_BLOCK (0 stays 0)."""
    return -(-length // KEY_BLOCK) * KEY_BLOCK


class KVCache:
    """Dense slots, grown on demand (``ensure``) up to ``max_slots`` x ``max_len``; a decode group is ``(first_slot,
    count)`` and a prefill slot its index."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_slots: int, max_len: int) -> None:
        self.dims = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_slots, self.max_len = max_slots, whole_blocks(max_len)
        self._slots: dict[tuple[int, int], torch.Tensor] = {}  # write_decode's slot indices, by group
        self._kernel = int8_kernel() if device.type == "cpu" else None  # write_decode's copies (``kv_cache.c``)
        self._hold(self._empty(0, 0), self._empty(0, 0))

    def _hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make these the cache's tensors, with each layer's views made once: a decode step reads and writes every
        layer's, and indexing the 5-d tensors anew cost ~8 us a layer (``decode_view``: the same views by group and
        length, for as long as the tensors are these)."""
        self.keys, self.values = keys, values
        self._layers = list(zip(keys.unbind(0), values.unbind(0), strict=True))
        self._views: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _empty(self, slots: int, length: int) -> torch.Tensor:
        layers, heads, dim = self.dims
        return torch.zeros(layers, slots, heads, length, dim, dtype=self.dtype, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def bytes_per_token(self) -> int:
        layers, heads, dim = self.dims
        return 2 * layers * heads * dim * self.keys.element_size()

    def ensure(self, num_slots: int, length: int) -> None:
        """Make room for ``num_slots`` slots of ``length`` positions, keeping what is cached."""
        length = whole_blocks(length)
        if num_slots <= self.num_slots and length <= self.capacity:
            return
        slots = _grow(self.num_slots, num_slots, MIN_SLOTS, self.max_slots)
        capacity = _grow(self.capacity, length, _MIN_LENGTH, self.max_len)  # all whole blocks, so is this
        keys, values = self._empty(slots, capacity), self._empty(slots, capacity)
        old_slots, old_len = self.num_slots, self.capacity
        keys[:, :old_slots, :, :old_len] = self.keys
        values[:, :old_slots, :, :old_len] = self.values
        self._hold(keys, values)

    def release(self) -> None:
        self._hold(self._empty(0, 0), self._empty(0, 0))

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (all layers)."""
        self.copy_to(src, self, dst, length)

    def copy_to(self, src: int, other: KVCache, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` of ``other`` (all layers)."""
        other.keys[:, dst, :, :length] = self.keys[:, src, :, :length]
        other.values[:, dst, :, :length] = self.values[:, src, :, :length]

    def load(self, slot: int, keys: torch.Tensor, values: torch.Tensor, start: int = 0) -> None:
        """Put precomputed KV (``[layers, kv_heads, length, head_dim]``) at ``start..`` of a slot."""
        end = start + keys.shape[2]
        self.keys[:, slot, :, start:end] = keys
        self.values[:, slot, :, start:end] = values

    def read(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of positions ``start..end`` of a slot, ``[layers, kv_heads, end - start, head_dim]``."""
        return self.keys[:, slot, :, start:end].clone(), self.values[:, slot, :, start:end].clone()

    # ---- what the model's attention calls ------------------------------------------------------------------
    def write_decode(self, layer: int, group: tuple[int, int], k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor) -> None:
        """k, v: ``[count, kv_heads, head_dim]`` for the group's slots at ``positions[i]``."""
        first, count = group
        if self._kernel is not None and self._kernel.kv_write(*self._layers[layer], first, k, v, positions):
            return
        # the slot indices, made once per group rather than per layer and step; on CUDA each time (a tensor made
        # while a graph records holds no values until the graph is replayed)
        slots = self._slots.get(group) if k.device.type == "cpu" else None
        if slots is None:
            slots = torch.arange(first, first + count, device=k.device)
            if k.device.type == "cpu":
                self._slots[group] = slots
        self.keys[layer][slots, :, positions] = k
        self.values[layer][slots, :, positions] = v

    def decode_view(self, layer: int, group: tuple[int, int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[count, kv_heads, length, head_dim]`` of the group's slots (views, no copy)."""
        first, count = group
        views = self._views.get((layer, first, count, length))
        if views is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            keys, values = self._layers[layer]
            views = self._views[layer, first, count, length] = (keys[first:first + count, :, :length],
                                                                values[first:first + count, :, :length])
        return views

    def write_repeat(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Decode rows of one slot at several positions (speculative decoding's drafts): k, v ``[rows, kv_heads,
        head_dim]`` at ``positions[i]``."""
        self.keys[layer][slot, :, positions] = k.transpose(0, 1)
        self.values[layer][slot, :, positions] = v.transpose(0, 1)

    def repeat_view(self, layer: int, slot: int, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's keys and values as ``rows`` decode rows read them: ``[rows, kv_heads, length, head_dim]``."""
        return (self.keys[layer, slot:slot + 1, :, :length].expand(rows, -1, -1, -1),
                self.values[layer, slot:slot + 1, :, :length].expand(rows, -1, -1, -1))

    def write_prefill(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: ``[t, kv_heads, head_dim]`` at positions ``start..start+t-1`` of one slot."""
        end = start + k.shape[0]
        self.keys[layer, slot, :, start:end] = k.transpose(0, 1)
        self.values[layer, slot, :, start:end] = v.transpose(0, 1)

    def prefill_view(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, kv_heads, length, head_dim]`` of one slot."""
        return self.keys[layer, slot:slot + 1, :, :length], self.values[layer, slot:slot + 1, :, :length]


def _grow(current: int, needed: int, minimum: int, limit: int) -> int:
    size = max(current, minimum)
    while size < needed:
        size *= 2
    return max(min(size, limit), needed)
