"""Stateful sessions (SageMaker's sticky-session routing), the same in every gunicorn worker.

A session is a file in the sessions folder (``option.sessions_path``, by default a folder the master makes before
forking): ``<id>.json`` holding when it expires (``option.sessions_expiration`` seconds after its creation, wall
time, so every worker reads the same). Creating writes a new file under a fresh UUID; closing removes it, and only
one worker's removal succeeds, so a second CLOSE of the same id is told the id is unknown; a lookup reads it. An id is
looked up only when it is a UUID, the form this server issues, so no header names a path. Expired files are swept
whenever a session is created.

What stays per worker: its engine's pins. A request that uses a session carries a ``SessionRef``
(``GenerationRequest.session``), and the worker's engine pins that conversation's prompt blocks in its prefix cache
(``engine.runners.prefix_store``) until the session expires or is closed. A CLOSE reaches one worker, which tells its
own engine at once (``on_end``); every other worker that served the session notices at a later session request (it
checks the sessions it has pinned, at most every ``RECONCILE_S``: ``reconcile``), and its pins also end by themselves
at the expiry time.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from handler.engine.types import SessionRef
from handler.errors import BadRequest
from handler.protocol.sessions import SESSION_ID_HEADER

log = logging.getLogger(__name__)

# How often a worker looks for sessions it served that another worker closed (one file read each): often enough that
# their pins go soon, seldom enough that a worker holding many sessions does not read them all on every request
RECONCILE_S = 5.0


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    expires_at: float               # time.time()

    @property
    def expires(self) -> str:
        """The expiry as SageMaker's NewSessionId header writes it (``2026-01-31T12:00:00Z``)."""
        return datetime.fromtimestamp(self.expires_at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def ref(self) -> SessionRef:
        """The engine's view: the same expiry on the monotonic clock the engine reads."""
        return SessionRef(self.session_id, time.monotonic() + (self.expires_at - time.time()))


class SessionStore:
    """The sessions of a server (module doc); ``on_end(id)`` tells this worker's engine a session it served ended."""

    def __init__(self, folder: Path, expiration_s: int, on_end: Callable[[str], None] = lambda session_id: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.folder = folder
        self.expiration_s = expiration_s
        self.on_end = on_end
        self._clock = clock
        self._held: set[str] = set()      # sessions this worker's engine may hold pins for
        self._reconciled = -RECONCILE_S
        self._lock = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)

    def create(self) -> Session:
        self.sweep()
        session = Session(str(uuid.uuid4()), self._clock() + self.expiration_s)
        path = self._path(session.session_id)
        partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        partial.write_text(json.dumps({"expires_at": session.expires_at}))
        os.replace(partial, path)
        log.info("session %s created, expires %s", session.session_id, session.expires)
        return session

    def get(self, session_id: str, param: str = SESSION_ID_HEADER) -> Session:
        """The live session of that id; 400 naming ``param`` when it is unknown, closed or expired."""
        self.reconcile()
        session = self._read(session_id)
        if session is None:
            raise BadRequest(f"session not found: {session_id} (unknown, closed or expired)", param=param,
                             code="session_not_found")
        with self._lock:
            self._held.add(session_id)
        return session

    def close(self, session_id: str, param: str = SESSION_ID_HEADER) -> None:
        """End the session; 400 naming ``param`` when it is unknown or already closed (or expired)."""
        session = self._read(session_id)
        try:
            if session is None:
                raise FileNotFoundError(session_id)
            self._path(session_id).unlink()
        except FileNotFoundError:
            raise BadRequest(f"session not found: {session_id} (unknown, closed or expired)", param=param,
                             code="session_not_found") from None
        log.info("session %s closed", session_id)
        self._ended(session_id)

    def reconcile(self) -> None:
        """Sessions this worker served that are closed (by another worker) or expired: their pins end here too
        (at most every ``RECONCILE_S``)."""
        with self._lock:
            if self._clock() - self._reconciled < RECONCILE_S:
                return
            self._reconciled = self._clock()
            held = list(self._held)
        for session_id in held:
            if self._read(session_id, remove_expired=False) is None:
                self._ended(session_id)

    def sweep(self) -> None:
        """Remove every expired session's file."""
        for path in self.folder.glob("*.json"):
            self._read(path.stem)

    def _ended(self, session_id: str) -> None:
        with self._lock:
            held = session_id in self._held
            self._held.discard(session_id)
        if held:
            self.on_end(session_id)

    def _read(self, session_id: str, remove_expired: bool = True) -> Session | None:
        """The session when its file exists and it has not expired (an expired one's file is removed)."""
        if not _is_uuid(session_id):
            return None
        path = self._path(session_id)
        try:
            expires_at = float(json.loads(path.read_text())["expires_at"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):  # gone, or half-written by a crashed writer
            return None
        if expires_at > self._clock():
            return Session(session_id, expires_at)
        if remove_expired:
            path.unlink(missing_ok=True)
        return None

    def _path(self, session_id: str) -> Path:
        return self.folder / f"{session_id}.json"


def _is_uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False
