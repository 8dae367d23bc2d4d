"""The slot-based KV cache: growth keeps contents, moves, per-row decode writes, release, size formula."""

from __future__ import annotations

import pytest
import torch

from handler.engine.kv_cache import KVCache

LAYERS, HEADS, DIM = 2, 3, 4


def cache(dtype: torch.dtype = torch.float32, max_slots: int = 16, max_len: int = 2048) -> KVCache:
    return KVCache(LAYERS, HEADS, DIM, dtype, torch.device("cpu"), max_slots=max_slots, max_len=max_len)


def kv(t: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct k, v of shape [t, heads, dim]."""
    k = base + torch.arange(t * HEADS * DIM, dtype=torch.float32).reshape(t, HEADS, DIM)
    return k, -k


def test_starts_empty() -> None:
    c = cache()
    assert (c.num_slots, c.capacity, c.num_bytes) == (0, 0, 0)


def test_first_ensure_uses_minimums() -> None:
    c = cache()
    c.ensure(1, 10)
    assert (c.num_slots, c.capacity) == (4, 256)
    assert tuple(c.keys.shape) == (LAYERS, 4, HEADS, 256, DIM)
    assert tuple(c.values.shape) == (LAYERS, 4, HEADS, 256, DIM)


def test_ensure_doubles_and_respects_limits() -> None:
    c = cache(max_slots=6, max_len=600)
    c.ensure(5, 300)
    assert (c.num_slots, c.capacity) == (6, 512)  # 8 slots capped at 6; 512 positions
    c.ensure(6, 513)
    assert (c.num_slots, c.capacity) == (6, 640)  # 1024 capped at 600, rounded up to whole key blocks of 64
    c.ensure(2, 100)                               # never shrinks
    assert (c.num_slots, c.capacity) == (6, 640)


def test_growth_keeps_contents() -> None:
    c = cache()
    c.ensure(2, 8)
    for layer in range(LAYERS):
        for slot in range(2):
            k, v = kv(8, base=100 * layer + 10 * slot)
            c.write_prefill(layer, slot, 0, k, v)
    before_k, before_v = c.keys[:, :2, :, :8].clone(), c.values[:, :2, :, :8].clone()
    c.ensure(9, 700)
    assert (c.num_slots, c.capacity) == (16, 1024)
    assert torch.equal(c.keys[:, :2, :, :8], before_k)
    assert torch.equal(c.values[:, :2, :, :8], before_v)
    assert c.keys[:, 2:].abs().sum() == 0 and c.keys[:, :, :, 8:].abs().sum() == 0


def test_write_prefill_and_view() -> None:
    c = cache()
    c.ensure(2, 16)
    k, v = kv(5, base=1.0)
    c.write_prefill(1, 1, 3, k, v)
    keys, values = c.view(1, 0, 2, 8)
    assert tuple(keys.shape) == (2, HEADS, 8, DIM)
    assert torch.equal(keys[1, :, 3:8], k.transpose(0, 1))
    assert torch.equal(values[1, :, 3:8], v.transpose(0, 1))
    assert keys[1, :, :3].abs().sum() == 0 and keys[0].abs().sum() == 0
    assert c.keys[0].abs().sum() == 0  # other layer untouched


def test_view_is_not_a_copy() -> None:
    c = cache()
    c.ensure(1, 4)
    keys, _ = c.view(0, 0, 1, 4)
    keys[0, 0, 0, 0] = 7.0
    assert c.keys[0, 0, 0, 0, 0] == 7.0


def test_move_copies_a_slot_all_layers() -> None:
    c = cache()
    c.ensure(4, 16)
    for layer in range(LAYERS):
        c.write_prefill(layer, 3, 0, *kv(10, base=50.0 * (layer + 1)))
        c.write_prefill(layer, 0, 0, *kv(10, base=-999.0))
    c.move(3, 0, 6)
    assert torch.equal(c.keys[:, 0, :, :6], c.keys[:, 3, :, :6])
    assert torch.equal(c.values[:, 0, :, :6], c.values[:, 3, :, :6])
    # positions past length are left alone; the source is unchanged
    expected_tail = kv(10, base=-999.0)[0].transpose(0, 1)[:, 6:]
    assert torch.equal(c.keys[0, 0, :, 6:10], expected_tail)
    assert torch.equal(c.keys[1, 3, :, :10], kv(10, base=100.0)[0].transpose(0, 1))


def test_write_decode_at_per_row_positions() -> None:
    c = cache()
    c.ensure(3, 16)
    positions = torch.tensor([5, 0, 9])
    k = torch.arange(3 * HEADS * DIM, dtype=torch.float32).reshape(3, HEADS, DIM) + 1
    c.write_decode(1, k, -k, positions)
    for slot, position in enumerate(positions.tolist()):
        assert torch.equal(c.keys[1, slot, :, position], k[slot])
        assert torch.equal(c.values[1, slot, :, position], -k[slot])
    assert c.keys[1].abs().sum() == k.abs().sum()  # nothing else written
    assert c.keys[0].abs().sum() == 0


def test_release_frees_and_regrows_empty() -> None:
    c = cache()
    c.ensure(4, 32)
    c.write_prefill(0, 0, 0, *kv(4, base=1.0))
    assert c.num_bytes > 0
    c.release()
    assert (c.num_slots, c.capacity, c.num_bytes) == (0, 0, 0)
    c.ensure(1, 4)
    assert c.keys.abs().sum() == 0


@pytest.mark.parametrize(("dtype", "size"), [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_bytes_per_token_formula(dtype: torch.dtype, size: int) -> None:
    c = cache(dtype)
    assert c.bytes_per_token == 2 * LAYERS * HEADS * DIM * size
    c.ensure(3, 10)
    assert c.num_bytes == c.bytes_per_token * c.num_slots * c.capacity
    assert c.keys.dtype == dtype
