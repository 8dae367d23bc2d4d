"""The one file the server's workers share stored responses, background runs' events and conversations in: a SQLite
database (``store.db``) in ``option.responses_store_dir``, by default a folder the master makes before forking.

SQLite because several processes write it: each write is one transaction that takes the database's write lock
(``BEGIN IMMEDIATE``, waiting up to ``BUSY_TIMEOUT_S`` for another worker's), and readers never wait (write-ahead
log). Each thread has its own connection (a connection must not be shared by threads that may use it at once).
Nothing here knows what a response is: the tables are made here, the stores (``responses``, ``conversations``) read
and write them.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FILE_NAME = "store.db"
BUSY_TIMEOUT_S = 30.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    used REAL NOT NULL,              -- when last written or read (the least recently used is forgotten first)
    status TEXT NOT NULL,            -- the response object's status, for updates that must see it
    response TEXT NOT NULL,          -- the response object (JSON)
    items TEXT NOT NULL,             -- the conversation it answered (JSON list of items)
    background INTEGER NOT NULL,
    stream INTEGER NOT NULL,         -- a background response created streaming: its events are kept
    owner INTEGER                    -- the process generating it (a background run)
);
CREATE INDEX IF NOT EXISTS responses_used ON responses (used);
CREATE TABLE IF NOT EXISTS response_events (
    response_id TEXT NOT NULL,
    seq INTEGER NOT NULL,            -- the event's sequence_number
    event TEXT NOT NULL,
    PRIMARY KEY (response_id, seq)
);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    used REAL NOT NULL,
    created_at INTEGER NOT NULL,
    metadata TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS conversations_used ON conversations (used);
CREATE TABLE IF NOT EXISTS conversation_items (
    conversation_id TEXT NOT NULL,
    position INTEGER NOT NULL,       -- the item's place in the conversation, oldest first
    item_id TEXT NOT NULL,
    item TEXT NOT NULL,
    PRIMARY KEY (conversation_id, position)
);
CREATE INDEX IF NOT EXISTS conversation_items_id ON conversation_items (conversation_id, item_id);
"""


class Database:
    """The shared SQLite file: ``transaction()`` for writes (and reads that must agree with them), ``rows()`` for
    plain reads."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / FILE_NAME
        self._local = threading.local()
        self._connection().executescript(SCHEMA)  # each statement its own transaction; a no-op once made

    def _connection(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            # autocommit mode: transactions are begun and ended here, explicitly
            connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                         check_same_thread=False)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")  # WAL's safe setting: a crash loses no committed write
            self._local.connection = connection
        return connection

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed when the block ends, rolled back when it raises."""
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        try:
            yield connection
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    def rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self._connection().execute(sql, args).fetchall()


def evict(db: sqlite3.Connection, table: str, capacity: int, keep: str = "0") -> list[str]:
    """Inside a transaction: the ids of ``table``'s least recently used rows past ``capacity``, deleted (rows where
    ``keep`` holds neither count nor are chosen); the caller deletes what hangs off them."""
    (count,) = db.execute(f"SELECT COUNT(*) FROM {table} WHERE NOT ({keep})").fetchone()  # the table names are ours
    if count <= capacity:
        return []
    ids = [row[0] for row in db.execute(
        f"SELECT id FROM {table} WHERE NOT ({keep}) ORDER BY used LIMIT ?", (count - capacity,))]
    db.executemany(f"DELETE FROM {table} WHERE id = ?", [(i,) for i in ids])
    return ids
