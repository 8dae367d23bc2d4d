"""Which LoRA adapters the server serves, the same in every gunicorn worker.

``POST /adapters`` reaches one worker; each worker has its own engine and so its own adapter store. What they share
is a registry file (``registry.json`` in ``option.adapter_registry_dir``, by default a folder the master makes
before forking): name -> (registration id, src, local folder, pin). A worker that registers or unregisters does
so under an exclusive lock on ``registry.lock`` and rewrites the file (a new file renamed into place, so readers need
no lock); every worker syncs its own store from the file before it answers about adapters or submits a request
naming one. Syncing is one read of a small file when nothing changed (its bytes are compared with the last seen,
not its mtime, whose granularity could hide a quick second write). The registration id tells a name deleted and
registered again (perhaps from another src) from the one a worker already holds.

What stays per worker: which adapters are loaded (each worker loads on first use, evicts under option.max_loras by
its own use) and so the ``loaded`` field and the load / evict metrics of the worker that answered. An ``s3://`` src
is downloaded once, by the registering worker; the others load the folder it recorded.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path

from handler.config import Settings
from handler.download.adapter import adapter_folder
from handler.engine.backend import AdapterManager
from handler.engine.types import AdapterInfo
from handler.errors import Conflict, NotFound, ServingError

log = logging.getLogger(__name__)

REGISTRY = "registry.json"


class SharedAdapters:
    """``AdapterManager`` over a worker's own store, kept equal to the shared registry (module doc)."""

    def __init__(self, store: AdapterManager, settings: Settings, folder: Path) -> None:
        self.store, self.settings = store, settings
        self.path, self.lock_path = folder / REGISTRY, folder / "registry.lock"
        folder.mkdir(parents=True, exist_ok=True)
        self._held: dict[str, str] = {}            # name -> registration id, as this worker's store holds them
        self._seen: bytes | None = None            # the registry's bytes this store was last synced to
        self._lock = threading.RLock()

    def register(self, name: str, src: str, *, preload: bool = True, pin: bool = False) -> AdapterInfo:
        folder = adapter_folder(src, self.settings)  # downloaded before taking the lock: other names go on
        with self._exclusive():
            entries = self._sync_locked()
            if name in entries:
                raise Conflict(f"the adapter {name} already exists; DELETE /adapters/{name} before registering it "
                               "again", param="name")
            info = self.store.register(name, src, preload=preload, pin=pin, folder=folder)
            registration = uuid.uuid4().hex
            entries[name] = {"id": registration, "src": src, "folder": str(folder), "pin": pin}
            self._write(entries)
            self._held[name] = registration
            return info

    def unregister(self, name: str) -> None:
        with self._exclusive():
            entries = self._sync_locked()
            if entries.pop(name, None) is None:
                raise NotFound(f"The adapter {name} was not found", param="name", code="adapter_not_found")
            self._write(entries)
            self._drop(name)

    def list(self) -> list[AdapterInfo]:
        self.sync()
        return self.store.list()

    def drain_events(self) -> list[tuple[str, str]]:
        return self.store.drain_events()

    def sync(self) -> None:
        """Make this worker's store hold exactly the registry's adapters (nothing to do when the file is as last
        seen)."""
        if self._raw() == self._seen:
            return
        with self._lock:
            self._sync_locked()

    def _sync_locked(self) -> dict[str, dict]:
        with self._lock:
            seen = self._raw()
            entries = json.loads(seen)["adapters"] if seen else {}
            for name in [n for n, held in self._held.items() if entries.get(n, {}).get("id") != held]:
                self._drop(name)
            for name, entry in entries.items():
                if name not in self._held:
                    self._take(name, entry)
            self._seen = seen
            return entries

    def _take(self, name: str, entry: dict) -> None:
        """Register another worker's adapter here (loaded on first use, or now when pinned)."""
        try:
            self.store.register(name, entry["src"], preload=False, pin=entry["pin"], folder=Path(entry["folder"]))
        except ServingError as error:  # e.g. its folder was removed since: this worker cannot serve it
            log.warning("adapter %s from the shared registry cannot be registered here: %s", name, error.message)
            return
        self._held[name] = entry["id"]

    def _drop(self, name: str) -> None:
        self._held.pop(name, None)
        try:
            self.store.unregister(name)
        except NotFound:
            pass

    def _raw(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def _write(self, entries: dict[str, dict]) -> None:
        data = json.dumps({"adapters": entries}).encode()
        partial = self.path.with_name(f"{REGISTRY}.{os.getpid()}.partial")
        partial.write_bytes(data)
        os.replace(partial, self.path)
        self._seen = data

    @contextmanager
    def _exclusive(self):
        """This thread alone in this worker, and this worker alone among the server's workers."""
        with self._lock, open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield
