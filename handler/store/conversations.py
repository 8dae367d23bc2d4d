"""Conversations (OpenAI's ``/v1/conversations``), shared by the workers: each its metadata and its items in order.
A response given ``conversation`` starts from its items and adds its input and output to them when it ends.

At most ``capacity`` conversations (``option.responses_store_size``, counted apart from responses), the least recently
used forgotten first, with their items.
"""

from __future__ import annotations

import json
import time

from handler.store.database import Database, evict


class ConversationStore:
    def __init__(self, db: Database, capacity: int) -> None:
        self.db, self.capacity = db, capacity

    def create(self, conversation_id: str, metadata: dict, items: list[dict]) -> dict:
        created_at = int(time.time())
        with self.db.transaction() as db:
            db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?)",
                       (conversation_id, time.time(), created_at, json.dumps(metadata)))
            _append(db, conversation_id, items)
            for gone in evict(db, "conversations", self.capacity):
                db.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (gone,))
        return conversation_object(conversation_id, created_at, metadata)

    def get(self, conversation_id: str) -> dict | None:
        with self.db.transaction() as db:
            row = _touch(db, conversation_id)
        return None if row is None else conversation_object(conversation_id, row[0], json.loads(row[1]))

    def update(self, conversation_id: str, metadata: dict) -> dict | None:
        with self.db.transaction() as db:
            row = _touch(db, conversation_id)
            if row is None:
                return None
            db.execute("UPDATE conversations SET metadata = ? WHERE id = ?", (json.dumps(metadata), conversation_id))
        return conversation_object(conversation_id, row[0], metadata)

    def delete(self, conversation_id: str) -> bool:
        with self.db.transaction() as db:
            gone = db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)).rowcount == 1
            db.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,))
        return gone

    def items(self, conversation_id: str) -> list[dict] | None:
        """Every item, oldest first (None: no such conversation)."""
        with self.db.transaction() as db:
            if _touch(db, conversation_id) is None:
                return None
            rows = db.execute("SELECT item FROM conversation_items WHERE conversation_id = ? ORDER BY position",
                              (conversation_id,)).fetchall()
        return [json.loads(row[0]) for row in rows]

    def add_items(self, conversation_id: str, items: list[dict]) -> bool:
        """Items added after the last (False: no such conversation)."""
        with self.db.transaction() as db:
            if _touch(db, conversation_id) is None:
                return False
            _append(db, conversation_id, items)
        return True

    def delete_item(self, conversation_id: str, item_id: str) -> bool | None:
        """None: no such conversation; False: no such item in it."""
        with self.db.transaction() as db:
            if _touch(db, conversation_id) is None:
                return None
            return db.execute("DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                              (conversation_id, item_id)).rowcount > 0


def conversation_object(conversation_id: str, created_at: int, metadata: dict) -> dict:
    return {"id": conversation_id, "object": "conversation", "created_at": created_at, "metadata": metadata}


def _touch(db, conversation_id: str) -> tuple | None:
    """The conversation's (created_at, metadata), marked used now; None when there is none."""
    row = db.execute("SELECT created_at, metadata FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
    if row is not None:
        db.execute("UPDATE conversations SET used = ? WHERE id = ?", (time.time(), conversation_id))
    return row


def _append(db, conversation_id: str, items: list[dict]) -> None:
    (last,) = db.execute("SELECT COALESCE(MAX(position), -1) FROM conversation_items WHERE conversation_id = ?",
                         (conversation_id,)).fetchone()
    db.executemany("INSERT INTO conversation_items VALUES (?, ?, ?, ?)",
                   [(conversation_id, last + 1 + i, item["id"], json.dumps(item)) for i, item in enumerate(items)])
