"""The prefix cache: whole ``PREFIX_BLOCK``s of prefilled KV kept by content, and the blocks stateful sessions pin.

``PrefixStore`` keeps whole blocks of prefilled tokens (keys and values, all layers) under a hash of every token
before and in the block (and of the image features there), least recently used first out; ``KVSpace`` counts them
under its budget and evicts them. Small blocks: what a later prompt recomputes is at most a block beyond its new
tokens (measured, 4-turn chat under a 1,000-token system prompt: 64-token blocks left 48-94 tokens to compute per
turn, 16-token blocks 46-49).

A stateful session (``types.SessionRef``) pins its prompts' blocks: a pinned block is out of the LRU order, so no
other request's blocks push it out, and the session's next turn finds its whole conversation so far. The pins end
when the session ends (``end_session``: closed) or expires; a block pinned by no session any more goes back to the
LRU order as the first out. Pins cost nothing when the budget has room; when it must make room (``evict_one``), it
evicts unpinned blocks first, then unpins sessions, the one least recently used first, never one a request that
stores a block of its own belongs to (``keep``) unless it is that request's own. A request that only offers
blocks (``store`` without a session) never unpins a session: pins yield to memory a running sequence needs (a
slab), not to other caching.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from handler.engine.types import SessionRef

# The prefix cache's unit (a prefilled chunk after a cached prefix may start anywhere: attention is cut at KEY_BLOCKs)
PREFIX_BLOCK = 16
Block = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class _Pins:
    keys: set[bytes]
    expires_at: float       # time.monotonic()


class PrefixStore:
    """Whole PREFIX_BLOCKs of prefilled KV by content hash, least recently used first out (``KVSpace`` evicts),
    and the blocks stateful sessions pin (module doc)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 enabled: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        element = torch.empty(0, dtype=dtype).element_size()
        self.block_bytes = 2 * num_layers * num_kv_heads * PREFIX_BLOCK * head_dim * element
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()     # unpinned, least recently used first
        self._pinned: dict[bytes, Block] = {}
        self._sessions: OrderedDict[str, _Pins] = OrderedDict()     # least recently used first
        self._holders: Counter[bytes] = Counter()                   # sessions pinning each pinned block
        self._clock = clock
        self._next_expiry = float("inf")
        self.num_sessions_evicted = 0     # sessions unpinned because the budget needed their memory

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks or key in self._pinned

    def __len__(self) -> int:
        return len(self._blocks) + len(self._pinned)

    @property
    def num_bytes(self) -> int:
        return len(self) * self.block_bytes

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def sessions(self) -> list[str]:
        """The sessions holding pins, least recently used first."""
        return list(self._sessions)

    def match(self, keys: list[bytes]) -> list[Block]:
        """The stored blocks of the longest run of ``keys`` from the first (each marked as just used)."""
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            else:
                block = self._pinned.get(key)
                if block is None:
                    break
            found.append(block)
        return found

    def touch(self, key: bytes) -> None:
        if key in self._blocks:
            self._blocks.move_to_end(key)

    def put(self, key: bytes, block: Block) -> None:
        self._blocks[key] = block

    # ---- sessions ------------------------------------------------------------------------------------------
    def pin(self, session: SessionRef, keys: Seq[bytes], *, replace: bool = False) -> None:
        """The session (now its most recent use) pins the stored blocks among ``keys``; with ``replace`` its pins
        become exactly those (a new prompt: blocks of an earlier branch of the conversation are let go)."""
        self._expire()
        pins = self._sessions.pop(session.session_id, None) or _Pins(set(), session.expires_at)
        pins.expires_at = session.expires_at
        wanted = {key for key in keys if key in self}
        for key in wanted - pins.keys:
            self._hold(key)
        if replace:
            for key in pins.keys - wanted:
                self._release(key)
            pins.keys = wanted
        else:
            pins.keys |= wanted
        self._sessions[session.session_id] = pins
        self._next_expiry = min(self._next_expiry, pins.expires_at)

    def end_session(self, session_id: str) -> None:
        """The session's pins end (closed, expired, or evicted); its blocks go first when room is needed."""
        pins = self._sessions.pop(session_id, None)
        for key in pins.keys if pins is not None else ():
            self._release(key)

    def _hold(self, key: bytes) -> None:
        if not self._holders[key]:
            self._pinned[key] = self._blocks.pop(key)
        self._holders[key] += 1

    def _release(self, key: bytes) -> None:
        self._holders[key] -= 1
        if self._holders[key] <= 0:
            del self._holders[key]
            self._blocks[key] = self._pinned.pop(key)
            self._blocks.move_to_end(key, last=False)

    def _expire(self) -> None:
        now = self._clock()
        if now < self._next_expiry:
            return
        for session_id in [s for s, pins in self._sessions.items() if pins.expires_at <= now]:
            self.end_session(session_id)
        self._next_expiry = min((pins.expires_at for pins in self._sessions.values()), default=float("inf"))

    # ---- eviction ------------------------------------------------------------------------------------------
    def evict_one(self, sessions: bool = True, keep: str | None = None) -> bool:
        """Evict the least recently used unpinned block; with ``sessions``, when there is none, unpin sessions
        (least recently used first, never ``keep``) until there is. False when nothing could go."""
        self._expire()
        while not self._blocks and sessions:
            oldest = next((s for s in self._sessions if s != keep), None)
            if oldest is None:
                break
            self.end_session(oldest)
            self.num_sessions_evicted += 1
        if not self._blocks:
            return False
        self._blocks.popitem(last=False)
        return True

    def clear(self) -> None:
        self._blocks.clear()
        self._pinned.clear()
        self._sessions.clear()
        self._holders.clear()
        self._next_expiry = float("inf")


def block_keys(token_ids: Seq[int], first: int, count: int, previous: bytes = b"",
               extra: Callable[[int], bytes] | None = None) -> list[bytes]:
    """Keys of whole blocks ``first..first+count-1`` of ``token_ids`` (``previous``: block ``first - 1``'s key).
    Each hashes the previous key, the block's tokens and ``extra(block)`` (a digest of the image features inside
    it), so a key names its whole prefix. A cryptographic hash: two different prefixes must never share cached KV,
    whoever sends them."""
    keys = []
    for number in range(first, first + count):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(array("i", token_ids[number * PREFIX_BLOCK:(number + 1) * PREFIX_BLOCK]).tobytes())
        if extra is not None:
            digest.update(extra(number))
        previous = digest.digest()
        keys.append(previous)
    return keys
