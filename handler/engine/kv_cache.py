"""A slot-based KV cache that grows with the batch and the longest sequence.

One tensor per K and V, ``[layers, slots, kv_heads, capacity, head_dim]``. Each running sequence owns one slot;
running sequences always occupy slots ``0..n-1`` (the engine moves the last slot into a hole when a sequence
leaves), so a decode step reads one contiguous block of slots. Capacity in slots and positions grows by doubling
up to the configured limits and is given back when the engine goes idle, so memory follows the load:
``2 * layers * kv_heads * head_dim * dtype_size`` bytes per sequence per token of capacity. Capacity is a
whole number of KEY_BLOCKs.
"""

from __future__ import annotations

import torch

_MIN_SLOTS = 4
_MIN_LENGTH = 256
# Attention reads keys in whole blocks of this many positions (``model.build_layout``), so capacity is a multiple.
KEY_BLOCK = 64


def whole_blocks(length: int) -> int:
    """``length`` rounded up to a multiple of KEY_BLOCK (0 stays 0)."""
    return -(-length // KEY_BLOCK) * KEY_BLOCK


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_slots: int, max_len: int) -> None:
        self.dims = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_slots, self.max_len = max_slots, whole_blocks(max_len)
        self.keys = self.values = self._empty(0, 0)

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
        slots = _grow(self.num_slots, num_slots, _MIN_SLOTS, self.max_slots)
        capacity = _grow(self.capacity, length, _MIN_LENGTH, self.max_len)  # all whole blocks, so is this
        keys, values = self._empty(slots, capacity), self._empty(slots, capacity)
        old_slots, old_len = self.num_slots, self.capacity
        keys[:, :old_slots, :, :old_len] = self.keys
        values[:, :old_slots, :, :old_len] = self.values
        self.keys, self.values = keys, values

    def release(self) -> None:
        """Give the memory back (the engine calls this when no sequence is running)."""
        self.keys = self.values = self._empty(0, 0)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (all layers)."""
        self.keys[:, dst, :, :length] = self.keys[:, src, :, :length]
        self.values[:, dst, :, :length] = self.values[:, src, :, :length]

    def load(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put precomputed KV (``[layers, kv_heads, length, head_dim]``) at the start of a slot."""
        length = keys.shape[2]
        self.keys[:, slot, :, :length] = keys
        self.values[:, slot, :, :length] = values

    def write_decode(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: ``[n, kv_heads, head_dim]`` for slots ``0..n-1`` at ``positions[i]``."""
        slots = torch.arange(k.shape[0], device=k.device)
        self.keys[layer][slots, :, positions] = k
        self.values[layer][slots, :, positions] = v

    def write_prefill(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: ``[t, kv_heads, head_dim]`` at positions ``start..start+t-1`` of one slot."""
        end = start + k.shape[0]
        self.keys[layer, slot, :, start:end] = k.transpose(0, 1)
        self.values[layer, slot, :, start:end] = v.transpose(0, 1)

    def view(self, layer: int, first_slot: int, end_slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[slots, kv_heads, length, head_dim]`` (views, no copy)."""
        return (self.keys[layer, first_slot:end_slot, :, :length],
                self.values[layer, first_slot:end_slot, :, :length])


def _grow(current: int, needed: int, minimum: int, limit: int) -> int:
    size = max(current, minimum)
    while size < needed:
        size *= 2
    return max(min(size, limit), needed)
