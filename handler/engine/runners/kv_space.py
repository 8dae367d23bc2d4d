"""The engine's budgeted KV memory (``KVSpace``) of dense slot caches (``model.kv_cache.KVCache``), and its prefix
store.

``KVSpace`` keeps that property under a memory budget. Sequences live in *size classes*: class ``c`` holds slots of
``256 * 2**c`` positions (the last class: the context length), in fixed-size slabs (``KVCache``s of equal byte
size, except where one slot of a large class is bigger). A sequence takes a slot in the smallest class its length
fits and moves up a class (one copy) when it outgrows it, so a slot holds at most about twice the sequence's tokens
and a long sequence never makes the short ones' slots long. Within a class, occupied slots are ``0..n-1`` (the last
one moves into a hole), so each slab is read as one batch. Allocated bytes (slabs and the prefix store) never
exceed the budget: a slab is allocated only when it fits, after evicting prefix blocks and freeing empty slabs.

Why not vLLM's paged blocks: reading a sequence's scattered blocks needs a gather (a copy of every key and value
each step) or a paged-attention kernel, which plain PyTorch on CPU lacks. Measured on this machine (2 threads,
per layer, 3 KV heads of 64): a 32 x 128-position decode attention took 0.24 ms dense, 3.4 ms with a gather, 0.79
ms computed block by block; 30 layers make that 7 ms against 100 ms per step.

Its prefix store (``prefix_store.PrefixStore``) counts under the same budget: a slab that must be allocated evicts
prefix blocks first, stateful sessions' pinned blocks last (the oldest session first).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from handler.engine.model.kv_cache import MIN_SLOTS, KVCache, whole_blocks
from handler.engine.runners.prefix_store import PREFIX_BLOCK, PrefixStore
from handler.engine.types import SessionRef

SMALLEST_CLASS = 256


class Occupant(Protocol):
    """What ``KVSpace`` reads and writes on a sequence."""

    kv_slot: SlotRef | None
    num_cached: int


@dataclass(slots=True)
class SlotRef:
    size_class: int
    index: int        # within the class: 0..occupants-1


@dataclass(frozen=True, slots=True)
class Repeat:
    """A decode group of ``rows`` rows that all read and write one slot (``KVSpace.repeat_group``)."""

    ref: SlotRef
    rows: int


@dataclass(slots=True)
class _SizeClass:
    capacity: int
    slab_slots: int
    slabs: list[KVCache]
    occupants: list[Occupant]

    def locate(self, index: int) -> tuple[KVCache, int]:
        return self.slabs[index // self.slab_slots], index % self.slab_slots


class KVSpace:
    """The engine's KV memory: size classes of slabs under ``budget`` bytes, and the prefix store (module doc)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 *, budget: int, max_len: int, max_slots: int, prefix_caching: bool = True) -> None:
        self.dims = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.budget = budget
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        self.max_len = whole_blocks(max_len)
        # a slab of the smallest class holds a full batch (one attention call per layer for short traffic), or a
        # quarter of the budget when that is smaller; every class's slab is that many positions, or one slot
        slab_positions = max(SMALLEST_CLASS, min(max_slots * SMALLEST_CLASS, budget // self.bytes_per_token // 4))
        self.classes: list[_SizeClass] = []
        capacity = min(SMALLEST_CLASS, self.max_len)
        while True:
            slots = max(1, min(max_slots, slab_positions // capacity))
            self.classes.append(_SizeClass(capacity, slots, [], []))
            if capacity >= self.max_len:
                break
            capacity = min(capacity * 2, self.max_len)
        self.prefixes = PrefixStore(num_layers, num_kv_heads, head_dim, dtype, enabled=prefix_caching)

    # ---- sizes ---------------------------------------------------------------------------------------------
    @property
    def num_bytes(self) -> int:
        """Bytes allocated: every slab, and the prefix store."""
        return sum(slab.num_bytes for c in self.classes for slab in c.slabs) + self.prefixes.num_bytes

    def class_for(self, length: int) -> int:
        for index, size_class in enumerate(self.classes):
            if length <= size_class.capacity:
                return index
        raise ValueError(f"{length} positions exceed the context ({self.max_len})")

    def bytes_for(self, length: int) -> int:
        """What one sequence of ``length`` positions takes at least: the first slab of its class."""
        c = self.classes[self.class_for(length)]
        return min(MIN_SLOTS, c.slab_slots) * c.capacity * self.bytes_per_token

    # ---- placing sequences ---------------------------------------------------------------------------------
    def fits(self, length: int) -> bool:
        """Whether a new sequence of ``length`` positions could be placed now (evicting prefix blocks and freeing
        empty slabs of other classes as needed)."""
        c = self.classes[self.class_for(length)]
        if len(c.occupants) < sum(slab.num_slots for slab in c.slabs):
            return True
        return self._next_slots(c)[1] <= self.budget - self.num_bytes + self._reclaimable(exclude=c)

    def place(self, owner: Occupant, length: int) -> bool:
        """Give ``owner`` a slot of at least ``length`` positions; False when the budget has no room for it."""
        index = self.class_for(length)
        c = self.classes[index]
        if len(c.occupants) == sum(slab.num_slots for slab in c.slabs):
            slots, size = self._next_slots(c)
            if not self._make_room(size, keep=c):
                return False
            if c.slabs and c.slabs[-1].num_slots < c.slab_slots:
                c.slabs[-1].ensure(slots, c.capacity)  # the first slab doubles (a copy: old and new counted)
            else:
                c.slabs.append(self._new_slab(c, slots))
        owner.kv_slot = SlotRef(index, len(c.occupants))
        c.occupants.append(owner)
        return True

    def _next_slots(self, c: _SizeClass) -> tuple[int, int]:
        """How a full class makes room for one more sequence: ``(slots, bytes to allocate)``. A class's first slab
        starts at four slots and doubles up to a whole slab (memory follows the load; the doubling copy holds the
        old slab beside the new one, and the budget counts both); the next slabs are whole."""
        if not c.slabs:
            slots = min(MIN_SLOTS, c.slab_slots)
        elif c.slabs[-1].num_slots < c.slab_slots:
            slots = min(2 * c.slabs[-1].num_slots, c.slab_slots)
        else:
            slots = c.slab_slots
        return slots, slots * c.capacity * self.bytes_per_token

    def grow(self, owner: Occupant, length: int) -> bool:
        """Make ``owner``'s slot hold ``length`` positions, moving it up a class (one copy of what it has cached)
        when it outgrows its own; False when the budget has no room (it keeps its slot)."""
        ref = owner.kv_slot
        if length <= self.classes[ref.size_class].capacity:
            return True
        if not self.place(owner, length):
            owner.kv_slot = ref
            return False
        self._copy(ref, owner.kv_slot, owner.num_cached)
        self._vacate(ref)
        return True

    def free(self, owner: Occupant) -> None:
        if owner.kv_slot is not None:
            self._vacate(owner.kv_slot)
            owner.kv_slot = None

    def copy(self, src: Occupant, dst: Occupant, length: int) -> None:
        """The first ``length`` positions of ``src``'s slot into ``dst``'s (a forked choice)."""
        self._copy(src.kv_slot, dst.kv_slot, length)

    def release(self) -> None:
        """Give every slab back (no sequence is running); the prefix store stays."""
        for c in self.classes:
            c.slabs.clear()

    def sort_key(self, owner: Occupant) -> tuple[int, int]:
        """Decode rows in this order make each slab's rows one run (``decode_groups``)."""
        return owner.kv_slot.size_class, owner.kv_slot.index

    def decode_groups(self, owners: Seq[Occupant]) -> list[tuple[tuple[int, int, int, int], int]]:
        """``owners`` (in ``sort_key`` order, every occupant) as runs within one slab: ``(handle, count)``, the
        handle ``(class, slab, first slot, count)`` for ``write_decode`` / ``decode_view``."""
        runs: list[list[int]] = []
        for owner in owners:
            ref = owner.kv_slot
            c = self.classes[ref.size_class]
            slab, slot = divmod(ref.index, c.slab_slots)
            run = runs[-1] if runs else None
            if run is not None and run[:2] == [ref.size_class, slab] and run[2] + run[3] == slot:
                run[3] += 1
            else:
                runs.append([ref.size_class, slab, slot, 1])
        return [((size_class, slab, first, count), count) for size_class, slab, first, count in runs]

    # ---- prefix blocks -------------------------------------------------------------------------------------
    def load_prefix(self, owner: Occupant, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        slab, slot = self._locate(owner.kv_slot)
        for number, (keys, values) in enumerate(blocks):
            slab.load(slot, keys, values, start=number * PREFIX_BLOCK)

    def store_blocks(self, owner: Occupant, keys: list[bytes], first: int, session: SessionRef | None = None) -> None:
        """Keep blocks ``first..first+len(keys)-1`` of ``owner``'s slot under ``keys``, making room under the
        budget by evicting older blocks (never slabs; a session's pins only for another session's blocks, the
        least recently used session first). A session's blocks are pinned for it as they are kept."""
        slab, slot = self._locate(owner.kv_slot)
        prefixes, keep = self.prefixes, session.session_id if session is not None else None
        for number, key in enumerate(keys, start=first):
            if key in prefixes:
                prefixes.touch(key)
            elif self.num_bytes + prefixes.block_bytes > self.budget and \
                    not prefixes.evict_one(sessions=session is not None, keep=keep):
                return
            else:
                prefixes.put(key, slab.read(slot, number * PREFIX_BLOCK, (number + 1) * PREFIX_BLOCK))
            if session is not None:
                prefixes.pin(session, (key,))

    # ---- attention's view ----------------------------------------------------------------------------------
    def repeat_group(self, owner: Occupant, rows: int) -> Repeat:
        """The decode-group handle of ``rows`` rows of one slot at consecutive positions (speculative decoding
        verifies its drafts as decode rows, so each is computed as that position's lone decode row would be)."""
        return Repeat(owner.kv_slot, rows)

    def write_decode(self, layer: int, group: tuple[int, int, int, int] | Repeat, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor) -> None:
        if isinstance(group, Repeat):
            slab, slot = self._locate(group.ref)
            slab.write_repeat(layer, slot, k, v, positions)
            return
        size_class, slab, first, count = group
        self.classes[size_class].slabs[slab].write_decode(layer, (first, count), k, v, positions)

    def decode_view(self, layer: int, group: tuple[int, int, int, int] | Repeat,
                    length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(group, Repeat):
            slab, slot = self._locate(group.ref)
            return slab.repeat_view(layer, slot, group.rows, length)
        size_class, slab, first, count = group
        return self.classes[size_class].slabs[slab].decode_view(layer, (first, count), length)

    def storage(self, group: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values tensors a decode group's rows write and read (their slab's whole tensors)."""
        size_class, slab, _first, _count = group
        cache = self.classes[size_class].slabs[slab]
        return cache.keys, cache.values

    def write_prefill(self, layer: int, ref: SlotRef, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slab, slot = self._locate(ref)
        slab.write_prefill(layer, slot, start, k, v)

    def prefill_view(self, layer: int, ref: SlotRef, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        slab, slot = self._locate(ref)
        return slab.prefill_view(layer, slot, length)

    # ---- inside --------------------------------------------------------------------------------------------
    def _locate(self, ref: SlotRef) -> tuple[KVCache, int]:
        return self.classes[ref.size_class].locate(ref.index)

    def _new_slab(self, c: _SizeClass, slots: int) -> KVCache:
        slab = KVCache(*self.dims, self.dtype, self.device, c.slab_slots, c.capacity)
        slab.ensure(slots, c.capacity)
        return slab

    def _copy(self, src: SlotRef, dst: SlotRef, length: int) -> None:
        """The first ``length`` positions of one slot into another, in any slabs."""
        source, source_slot = self._locate(src)
        target, target_slot = self._locate(dst)
        source.copy_to(source_slot, target, target_slot, length)

    def _vacate(self, ref: SlotRef) -> None:
        """Free slot ``ref``; the class's last occupant moves into it so occupied slots stay ``0..n-1``."""
        c = self.classes[ref.size_class]
        last = c.occupants.pop()
        if len(c.occupants) != ref.index:
            self._copy(SlotRef(ref.size_class, len(c.occupants)), ref, last.num_cached)
            c.occupants[ref.index] = last
            last.kv_slot = SlotRef(ref.size_class, ref.index)

    def _empty_slabs(self, exclude: _SizeClass | None) -> list[tuple[_SizeClass, int]]:
        """Slabs no occupant uses (trailing ones of each class), as ``(class, bytes)``."""
        found = []
        for c in self.classes:
            if c is exclude:
                continue
            used = -(-len(c.occupants) // c.slab_slots)
            found += [(c, slab.num_bytes) for slab in c.slabs[used:]]
        return found

    def _reclaimable(self, exclude: _SizeClass | None) -> int:
        return self.prefixes.num_bytes + sum(size for _c, size in self._empty_slabs(exclude))

    def _make_room(self, size: int, keep: _SizeClass) -> bool:
        """Free empty slabs of other classes, then the oldest prefix blocks, until ``size`` more bytes fit."""
        if self.num_bytes + size <= self.budget:
            return True
        if size > self.budget - self.num_bytes + self._reclaimable(exclude=keep):
            return False
        for c, _size in sorted(self._empty_slabs(keep), key=lambda item: -item[1]):
            c.slabs.pop()
            if self.num_bytes + size <= self.budget:
                return True
        while self.num_bytes + size > self.budget and self.prefixes.evict_one():
            pass
        return self.num_bytes + size <= self.budget
