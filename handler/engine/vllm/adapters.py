"""LoRA adapters on vLLM (option.enable_lora): our registry of names and folders over vLLM's own adapter cache.

UNTESTED HERE: vLLM is not installed on this machine; this follows vLLM's documented API (``AsyncEngineArgs``'
``enable_lora``, ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``; ``vllm.lora.request.LoRARequest(lora_name,
lora_int_id, lora_path)``; ``AsyncLLM.add_lora`` / ``remove_lora`` / ``pin_lora``; ``generate(...,
lora_request=...)``) and is exercised only by ``make test-vllm``. vLLM loads, caches and evicts adapters itself
(least recently used, ``max_loras`` on the device per batch, ``max_cpu_loras`` in host memory), so no load or evict
events are reported from here; a request names a registered adapter and carries its ``LoRARequest``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from handler.engine.types import AdapterInfo
from handler.errors import BadRequest, Conflict, NotFound

_WAIT_S = 60.0


@dataclass(slots=True)
class _Entry:
    name: str
    src: str
    pinned: bool
    request: object          # vllm.lora.request.LoRARequest
    rank: int


class VllmAdapters:
    """``backend.AdapterManager`` over vLLM's engine; ``engine`` and ``loop`` are the backend's once started."""

    def __init__(self, engine: Callable[[], object], loop: Callable[[], asyncio.AbstractEventLoop],
                 max_rank: int) -> None:
        self._engine, self._loop, self.max_rank = engine, loop, max_rank
        self._entries: dict[str, _Entry] = {}
        self._ids = itertools.count(1)   # vLLM's lora_int_id must be > 0 and unique per adapter
        self._lock = threading.Lock()

    def register(self, name: str, src: str, *, preload: bool = True, pin: bool = False,
                 folder: Path | None = None) -> AdapterInfo:
        """``folder``: where ``src``'s files are (the server downloads an ``s3://`` src first); unset: ``src`` is
        a local folder."""
        from vllm.lora.request import LoRARequest

        if folder is None and src.startswith("s3://"):
            raise BadRequest(f"src {src}: an s3:// src is downloaded by the server (POST /adapters), not here",
                             param="src")
        folder = folder or Path(src.removeprefix("file://"))
        rank = _checked_rank(folder, self.max_rank)
        with self._lock:
            if name in self._entries:
                raise Conflict(f"the adapter {name} already exists; DELETE /adapters/{name} before registering it "
                               "again", param="name")
            entry = _Entry(name, src, pin, LoRARequest(name, next(self._ids), str(folder)), rank)
            if preload or pin:
                self._call("add_lora", entry.request)
            if pin:
                self._call("pin_lora", entry.request.lora_int_id)
            self._entries[name] = entry
        return AdapterInfo(name, src, pin, preload or pin, rank)

    def unregister(self, name: str) -> None:
        with self._lock:
            entry = self._entries.pop(name, None)
        if entry is None:
            raise NotFound(f"The adapter {name} was not found", param="name", code="adapter_not_found")
        self._call("remove_lora", entry.request.lora_int_id)

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [AdapterInfo(e.name, e.src, e.pinned, True, e.rank) for e in self._entries.values()]

    def resolve(self, name: str, param: str = "adapter") -> object:
        """The ``LoRARequest`` a request names; 404 naming it when unknown."""
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"The adapter {name} was not found (GET /adapters lists them)", param=param,
                           code="adapter_not_found")
        return entry.request

    def drain_events(self) -> list[tuple[str, str]]:
        return []

    def _call(self, method: str, *args) -> object:
        """Run one of AsyncLLM's adapter coroutines on the backend's loop and wait for it."""
        future = asyncio.run_coroutine_threadsafe(getattr(self._engine(), method)(*args), self._loop())
        return future.result(_WAIT_S)


def _checked_rank(folder: Path, max_rank: int) -> int:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise BadRequest(f"{folder}: not a PEFT adapter folder (no adapter_config.json)", param="src")
    rank = json.loads(path.read_text()).get("r")
    if not isinstance(rank, int) or rank < 1 or rank > max_rank:
        raise BadRequest(f"{path}: rank {rank} is greater than max_lora_rank ({max_rank}, option.max_lora_rank) or "
                         "not a positive integer", param="src")
    return rank
