"""KV memory: the dense slot cache (growth keeps contents, moves, per-row decode writes, release, size formula) and
the budgeted space of size classes with its prefix store (the budget holds, contents survive moves, LRU)."""

from __future__ import annotations

import pytest
import torch

from handler.engine.model.kv_cache import KVCache
from handler.engine.runners.kv_space import KVSpace
from handler.engine.runners.prefix_store import PREFIX_BLOCK, block_keys

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
    keys, values = c.decode_view(1, (0, 2), 8)
    assert tuple(keys.shape) == (2, HEADS, 8, DIM)
    assert torch.equal(keys[1, :, 3:8], k.transpose(0, 1))
    assert torch.equal(values[1, :, 3:8], v.transpose(0, 1))
    assert keys[1, :, :3].abs().sum() == 0 and keys[0].abs().sum() == 0
    assert c.keys[0].abs().sum() == 0  # other layer untouched


def test_view_is_not_a_copy() -> None:
    c = cache()
    c.ensure(1, 4)
    keys, _ = c.prefill_view(0, 0, 4)
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
    c.write_decode(1, (0, 3), k, -k, positions)
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


class Owner:
    """A sequence as ``KVSpace`` sees it."""

    def __init__(self, name: str, num_cached: int = 0) -> None:
        self.name, self.num_cached, self.kv_slot = name, num_cached, None

    def __repr__(self) -> str:
        return self.name


PER_TOKEN = 2 * LAYERS * HEADS * DIM * 4  # fp32


def space(budget_tokens: int, max_slots: int = 16, max_len: int = 8192) -> KVSpace:
    return KVSpace(LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"), budget=budget_tokens * PER_TOKEN,
                   max_len=max_len, max_slots=max_slots)


def fill(s: KVSpace, owner: Owner, length: int, base: float) -> None:
    """Write ``length`` distinct positions into every layer of ``owner``'s slot."""
    for layer in range(LAYERS):
        s.write_prefill(layer, owner.kv_slot, 0, *kv(length, base + 1000 * layer))
    owner.num_cached = length


def read(s: KVSpace, owner: Owner, length: int) -> torch.Tensor:
    return torch.stack([s.prefill_view(layer, owner.kv_slot, length)[0][0] for layer in range(LAYERS)])


def expected(length: int, base: float) -> torch.Tensor:
    return torch.stack([kv(length, base + 1000 * layer)[0].transpose(0, 1) for layer in range(LAYERS)])


def test_one_long_and_many_short_sequences_stay_within_the_budget() -> None:
    s = space(budget_tokens=16 * 8192 // 4)   # a quarter of what 16 dense slots of 8192 positions took
    short = [Owner(f"s{i}") for i in range(15)]
    for owner in short:
        assert s.place(owner, 100)
    long = Owner("long")
    assert s.place(long, 7000)
    assert s.num_bytes <= s.budget
    # 15 short slots in one slab of the smallest class, the long one in a slot of 8192: not 16 x 8192
    assert s.num_bytes == (16 * 256 + 8192) * PER_TOKEN
    groups = s.decode_groups(sorted(short + [long], key=s.sort_key))
    assert [count for _handle, count in groups] == [15, 1]


def test_placing_past_the_budget_fails_and_fits_says_so_first() -> None:
    s = space(budget_tokens=2 * 4096, max_slots=4)
    owners = [Owner(f"o{i}") for i in range(3)]
    assert s.fits(4000) and s.place(owners[0], 4000)
    assert s.fits(4000) and s.place(owners[1], 4000)
    assert not s.fits(4000) and not s.place(owners[2], 4000)
    assert owners[2].kv_slot is None
    assert s.num_bytes <= s.budget
    s.free(owners[1])
    assert s.place(owners[2], 4000)


def test_growth_moves_up_a_class_and_keeps_what_is_cached() -> None:
    s = space(budget_tokens=4096)
    owner = Owner("a")
    s.place(owner, 200)
    fill(s, owner, 200, base=5.0)
    assert s.classes[owner.kv_slot.size_class].capacity == 256
    assert s.grow(owner, 300)
    assert s.classes[owner.kv_slot.size_class].capacity == 512
    assert torch.equal(read(s, owner, 200), expected(200, 5.0))


def test_growth_that_does_not_fit_keeps_the_old_slot() -> None:
    s = space(budget_tokens=600)  # slabs of one slot: 256 positions held, 512 more do not fit
    owner = Owner("a")
    s.place(owner, 100)
    fill(s, owner, 100, base=1.0)
    assert not s.grow(owner, 600)
    assert s.classes[owner.kv_slot.size_class].capacity == 256
    assert torch.equal(read(s, owner, 100), expected(100, 1.0))


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]])
def test_slots_stay_contiguous_and_keep_their_contents_under_any_removal_order(order: list[int]) -> None:
    s = space(budget_tokens=1 << 16, max_slots=2)  # two slots per slab: removals cross slabs
    owners = [Owner(f"o{i}") for i in range(5)]
    for i, owner in enumerate(owners):
        s.place(owner, 50)
        fill(s, owner, 10 + i, base=100.0 * i)
    live = list(range(5))
    for i in order:
        s.free(owners[i])
        assert owners[i].kv_slot is None
        live.remove(i)
        assert sorted(owners[j].kv_slot.index for j in live) == list(range(len(live)))
        for j in live:
            assert torch.equal(read(s, owners[j], 10 + j), expected(10 + j, 100.0 * j))


def test_copy_gives_a_fork_the_prompt() -> None:
    s = space(budget_tokens=4096)
    parent, child = Owner("p"), Owner("c")
    s.place(parent, 64)
    fill(s, parent, 40, base=3.0)
    s.place(child, 64)
    s.copy(parent, child, 40)
    assert torch.equal(read(s, child, 40), expected(40, 3.0))


def test_prefix_blocks_round_trip_and_are_evicted_oldest_first_for_slabs() -> None:
    s = space(budget_tokens=1024 + 2 * PREFIX_BLOCK, max_slots=4)  # slabs of one slot at this budget
    writer = Owner("w")
    s.place(writer, 200)
    fill(s, writer, 3 * PREFIX_BLOCK, base=7.0)
    keys = block_keys(list(range(3 * PREFIX_BLOCK)), 0, 3)
    s.store_blocks(writer, keys, 0)
    assert len(s.prefixes) == 3 and s.num_bytes <= s.budget
    reader = Owner("r")
    s.place(reader, 250)
    blocks = s.prefixes.match(keys[:2])
    s.load_prefix(reader, blocks)
    assert torch.equal(read(s, reader, 2 * PREFIX_BLOCK), expected(3 * PREFIX_BLOCK, 7.0)[:, :, :2 * PREFIX_BLOCK])
    # a slot of 1024 needs room: the empty slabs go first, then the least recently used block (the third)
    s.free(writer)
    s.free(reader)
    big = Owner("big")
    assert s.place(big, 600)
    assert s.num_bytes <= s.budget
    assert keys[2] not in s.prefixes and keys[0] in s.prefixes and keys[1] in s.prefixes


def test_block_keys_name_the_whole_prefix() -> None:
    tokens = list(range(3 * PREFIX_BLOCK))
    keys = block_keys(tokens, 0, 3)
    assert keys == block_keys(tokens + [1, 2, 3], 0, 3)
    assert block_keys(tokens, 2, 1, previous=keys[1]) == keys[2:]
    changed = block_keys([99] + tokens[1:], 0, 3)
    assert all(a != b for a, b in zip(keys, changed, strict=True))  # an early token changes every later key
    image = block_keys(tokens, 0, 3, extra=lambda block: b"image A" if block == 1 else b"")
    other = block_keys(tokens, 0, 3, extra=lambda block: b"image B" if block == 1 else b"")
    assert image[0] == other[0] and image[1] != other[1] and image[2] != other[2]


def test_image_features_enter_the_key_of_the_blocks_they_fall_in() -> None:
    from handler.engine.runners.model_runner import _embeds_digest
    from handler.engine.types import PromptEmbeds

    positions = tuple(range(66, 76))  # inside block 4 (positions 64..79)
    a = PromptEmbeds(positions, torch.ones(10, 8))
    b = PromptEmbeds(positions, torch.ones(10, 8) * 2)
    assert _embeds_digest(a, 0) == _embeds_digest(b, 0) == b""
    assert _embeds_digest(a, 4) != _embeds_digest(b, 4)
    assert _embeds_digest(a, 4) == _embeds_digest(PromptEmbeds(positions, torch.ones(10, 8)), 4)


def test_a_class_first_slab_starts_small_and_doubles_keeping_contents() -> None:
    s = space(budget_tokens=1 << 16, max_slots=16)  # a whole slab of the smallest class: 16 slots of 256
    owners = [Owner(f"o{i}") for i in range(9)]
    s.place(owners[0], 100)
    fill(s, owners[0], 100, base=9.0)
    assert s.num_bytes == 4 * 256 * PER_TOKEN  # one light request does not take a whole batch's slab
    for owner in owners[1:]:
        assert s.place(owner, 100)
    assert s.num_bytes == 16 * 256 * PER_TOKEN  # 4 -> 8 -> 16 slots, still one slab (one attention call)
    assert len(s.classes[0].slabs) == 1
    assert torch.equal(read(s, owners[0], 100), expected(100, 9.0))
