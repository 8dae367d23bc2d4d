"""``Store``: what a worker's endpoints share of the state that outlives a request, opened once per worker.

The folder is ``option.responses_store_dir``; the master sets it (a temporary folder) before forking when the user
did not, and the key (``option.responses_encryption_key``) likewise, so every worker of one server opens the same
database and seals with the same key. An app made without the master (tests, a user's script) gets a folder and a key
of its own.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from handler.config import Settings
from handler.store.background import BackgroundRuns
from handler.store.conversations import ConversationStore
from handler.store.database import Database
from handler.store.responses import ResponseStore
from handler.store.sealing import ReasoningSeal, new_key


@dataclass(frozen=True, slots=True)
class Store:
    responses: ResponseStore
    conversations: ConversationStore
    seal: ReasoningSeal
    runs: BackgroundRuns


def open_store(settings: Settings, count_work: Callable[[int], None] = lambda delta: None) -> Store:
    folder = Path(settings.responses_store_dir or tempfile.mkdtemp(prefix="llm-responses-"))
    db = Database(folder)
    responses = ResponseStore(db, settings.responses_store_size)
    return Store(responses, ConversationStore(db, settings.responses_store_size),
                 ReasoningSeal(settings.responses_encryption_key or new_key()), BackgroundRuns(responses, count_work))
