"""The prefix store's pins for stateful sessions: what other traffic cannot evict, what the budget evicts when a
running sequence needs the memory (the least recently used session first), and when pins end (closed, expired, or a
new branch of the conversation)."""

from __future__ import annotations

import time

import torch

from handler.engine.runners.kv_space import KVSpace
from handler.engine.runners.prefix_store import PREFIX_BLOCK, PrefixStore, block_keys
from handler.engine.types import SessionRef

LAYERS, HEADS, DIM = 2, 2, 4
PER_TOKEN = 2 * LAYERS * HEADS * DIM * 4  # fp32
BLOCK = (torch.zeros(1), torch.zeros(1))
LATER = time.monotonic() + 3600


class Owner:
    def __init__(self, num_cached: int = 0) -> None:
        self.num_cached, self.kv_slot = num_cached, None


def session(name: str, expires_at: float = LATER) -> SessionRef:
    return SessionRef(name, expires_at)


def keys_of(seed: int, count: int) -> list[bytes]:
    return block_keys([seed] * (count * PREFIX_BLOCK), 0, count)


def store() -> PrefixStore:
    return PrefixStore(LAYERS, HEADS, DIM, torch.float32)


def test_other_traffic_cannot_evict_a_sessions_blocks_but_evicts_its_own_oldest_first() -> None:
    s = KVSpace(LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"), budget=1024 * PER_TOKEN, max_len=256,
                max_slots=2)
    writer = Owner()
    assert s.place(writer, 256)  # one 256-position slab: the budget leaves room for 48 blocks besides
    room = (s.budget - s.num_bytes) // s.prefixes.block_bytes
    mine, theirs = keys_of(1, 8), keys_of(2, room)
    s.store_blocks(writer, mine, 0, session("conversation"))
    s.store_blocks(writer, theirs, 0)                      # more than fits beside mine
    assert all(key in s.prefixes for key in mine)          # pinned: not one was evicted
    assert s.num_bytes <= s.budget
    assert theirs[0] not in s.prefixes and theirs[-1] in s.prefixes  # the other traffic evicted its own oldest


def test_a_slab_a_running_sequence_needs_unpins_the_least_recently_used_session_first() -> None:
    s = KVSpace(LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"), budget=1024 * PER_TOKEN, max_len=512,
                max_slots=1)
    writer = Owner()
    assert s.place(writer, 256)
    old, recent = keys_of(1, 20), keys_of(2, 20)          # 640 positions of blocks beside the 256-slab
    s.store_blocks(writer, old, 0, session("old"))
    s.store_blocks(writer, recent, 0, session("recent"))
    s.free(writer)
    assert s.prefixes.sessions() == ["old", "recent"]
    big = Owner()
    assert s.place(big, 512)  # a 512-slab: the empty 256-slab goes, then 8 pinned blocks must
    assert s.num_bytes <= s.budget
    assert s.prefixes.sessions() == ["recent"] and s.prefixes.num_sessions_evicted == 1
    assert all(key in s.prefixes for key in recent)
    assert sum(key in s.prefixes for key in old) == 12   # unpinned, and the room came out of them alone


def test_a_session_blocks_store_may_unpin_an_older_session_but_never_its_own() -> None:
    s = KVSpace(LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"), budget=1024 * PER_TOKEN, max_len=256,
                max_slots=2)
    writer = Owner()
    assert s.place(writer, 256)
    room = (s.budget - s.num_bytes) // s.prefixes.block_bytes
    first = keys_of(1, room)
    s.store_blocks(writer, first, 0, session("first"))     # the whole room, pinned by one session
    second = keys_of(2, 4)
    s.store_blocks(writer, second, 0, session("second"))   # a newer session's blocks: the older one gives way
    assert all(key in s.prefixes for key in second)
    assert s.prefixes.sessions() == ["second"] and s.num_bytes <= s.budget
    again = keys_of(3, room)
    s.store_blocks(writer, again, 0, session("second"))    # its own pins are never what it evicts
    assert all(key in s.prefixes for key in second)


def test_closing_ends_the_pins_and_its_blocks_go_first() -> None:
    p = store()
    mine, other = keys_of(1, 2), keys_of(2, 2)
    for key in mine + other:
        p.put(key, BLOCK)
    p.pin(session("s"), mine)
    p.touch(other[0])
    p.end_session("s")
    assert p.sessions() == [] and p.num_pinned == 0
    p.evict_one(sessions=False)
    p.evict_one(sessions=False)
    assert all(key in p for key in other) and not any(key in p for key in mine)


def test_an_expired_session_lets_go_at_the_next_eviction() -> None:
    now = [100.0]
    p = PrefixStore(LAYERS, HEADS, DIM, torch.float32, clock=lambda: now[0])
    mine = keys_of(1, 2)
    for key in mine:
        p.put(key, BLOCK)
    p.pin(session("s", expires_at=150.0), mine)
    assert not p.evict_one(sessions=False)  # everything is pinned, and the session lives
    now[0] = 151.0
    assert p.evict_one(sessions=False)      # expired: its blocks are ordinary again
    assert p.sessions() == [] and len(p) == 1 and p.num_sessions_evicted == 0


def test_a_new_prompt_of_the_session_lets_an_earlier_branch_go() -> None:
    p = store()
    trunk, branch = keys_of(1, 3), block_keys([7] * (4 * PREFIX_BLOCK), 0, 4)
    for key in trunk + branch:
        p.put(key, BLOCK)
    p.pin(session("s"), trunk)
    p.pin(session("s"), branch[:2], replace=True)  # the next prompt shares only these blocks with what is pinned
    assert p.num_pinned == 2
    assert all(key not in p._pinned for key in trunk)


def test_a_block_two_sessions_share_stays_pinned_until_both_end() -> None:
    p = store()
    shared = keys_of(1, 1)
    p.put(shared[0], BLOCK)
    p.pin(session("a"), shared)
    p.pin(session("b"), shared)
    p.end_session("a")
    assert not p.evict_one(sessions=False)
    p.end_session("b")
    assert p.evict_one(sessions=False) and len(p) == 0


def test_matching_finds_pinned_blocks() -> None:
    p = store()
    keys = keys_of(1, 3)
    for key in keys:
        p.put(key, BLOCK)
    p.pin(session("s"), keys[:2])
    assert len(p.match(keys)) == 3
