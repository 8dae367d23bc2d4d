"""The lean engine's LoRA adapters: which are registered (name -> folder), which are loaded (at most ``max_loaded``),
and which go when another must come in (the least recently used unpinned one).

Why eviction never waits for requests: a request holds the ``AdapterWeights`` object it was submitted with, so an
adapter evicted while it runs stays alive for that request (Python keeps it) and only new requests reload it.
Callers are the HTTP threads (routes, submit); the engine thread only reads the weights its sequences hold. One lock
guards the tables; loading a small adapter under it (milliseconds) keeps the rules simple.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from handler.engine.model.lora import AdapterWeights, read_adapter_config
from handler.engine.types import AdapterInfo
from handler.errors import BadRequest, Conflict, NotFound

Loader = Callable[[Path, str], AdapterWeights]


@dataclass(slots=True)
class _Entry:
    name: str
    src: str
    folder: Path
    pinned: bool
    weights: AdapterWeights | None = None


class AdapterStore:
    """``backend.AdapterManager`` for the lean engine (module doc)."""

    def __init__(self, load: Loader, max_loaded: int, max_rank: int) -> None:
        self._load, self.max_loaded, self.max_rank = load, max_loaded, max_rank
        self._entries: dict[str, _Entry] = {}
        self._loaded: OrderedDict[str, None] = OrderedDict()   # least recently used first
        self._events: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def register(self, name: str, src: str, *, preload: bool = True, pin: bool = False,
                 folder: Path | None = None) -> AdapterInfo:
        """``folder``: where ``src``'s files are (the server downloads an ``s3://`` src first); unset: ``src`` is
        a local folder."""
        folder = folder or _local_folder(src)
        with self._lock:
            if name in self._entries:
                raise Conflict(f"the adapter {name} already exists; DELETE /adapters/{name} before registering it "
                               "again", param="name")
            read_adapter_config(folder, self.max_rank)  # a folder that is no adapter fails now, not at first use
            entry = _Entry(name, src, folder, pin)
            if preload or pin:  # a pinned adapter is kept loaded, so it loads now
                self._bring_in(entry, folder)
            self._entries[name] = entry
            return _info(entry)

    def unregister(self, name: str) -> None:
        with self._lock:
            if self._entries.pop(name, None) is None:
                raise NotFound(f"The adapter {name} was not found", param="name", code="adapter_not_found")
            self._loaded.pop(name, None)

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [_info(entry) for entry in self._entries.values()]

    def resolve(self, name: str, param: str = "adapter") -> AdapterWeights:
        """The weights a request named, loaded (evicting another) when they are not; 404 naming it when unknown."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise NotFound(f"The adapter {name} was not found (GET /adapters lists them)", param=param,
                               code="adapter_not_found")
            if entry.weights is None:
                self._bring_in(entry, entry.folder)
            self._loaded.move_to_end(name)
            return entry.weights

    def drain_events(self) -> list[tuple[str, str]]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def _bring_in(self, entry: _Entry, folder: Path) -> None:
        """Load ``entry``, then evict the least recently used unpinned adapter when ``max_loaded`` were in (loaded
        first: an adapter that fails to load evicts nothing)."""
        victim = None
        if len(self._loaded) >= self.max_loaded:
            victim = next((n for n in self._loaded if not self._entries[n].pinned), None)
            if victim is None:
                raise Conflict(f"all {self.max_loaded} loaded adapters are pinned (option.max_loras); unregister "
                               f"one to load {entry.name}", param="name")
        entry.weights = self._load(folder, entry.name)
        if victim is not None:
            self._entries[victim].weights = None
            del self._loaded[victim]
            self._events.append(("evicted", victim))
        self._loaded[entry.name] = None
        self._events.append(("loaded", entry.name))


def _local_folder(src: str) -> Path:
    if src.startswith("s3://"):
        raise BadRequest(f"src {src}: an s3:// src is downloaded by the server (POST /adapters), not here",
                         param="src")
    folder = Path(src.removeprefix("file://"))
    if not folder.is_dir():
        raise BadRequest(f"src {src}: no such folder", param="src")
    return folder


def _info(entry: _Entry) -> AdapterInfo:
    weights = entry.weights
    return AdapterInfo(entry.name, entry.src, entry.pinned, weights is not None,
                       None if weights is None else weights.rank, () if weights is None else weights.targets)
