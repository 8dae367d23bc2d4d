"""The Responses API's stored responses (``store: true``): what ``previous_response_id`` continues and
``GET /v1/responses/{id}`` returns.

Kept in this worker process's memory, most recently used last, at most ``option.responses_store_size`` of them (the
least recently used is forgotten first; 0 stores nothing). Each entry is the response object and the conversation
it answered (the items before its output), so a continuation is that conversation, the response's output, then the
new input. Nothing is shared between gunicorn workers or survives a restart: README's "Responses API" says what
that means behind SageMaker.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict                  # the response object as the client got it
    items: tuple[dict, ...]         # the conversation it answered: earlier turns, then its own input items

    @property
    def conversation(self) -> list[dict]:
        """What a response continuing this one starts from: the items, then this response's output."""
        return [*self.items, *self.response["output"]]


class ResponseStore:
    """A bounded LRU map from response id to ``StoredResponse``, safe to use from the worker's threads."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._entries[stored.response["id"]] = stored
            self._entries.move_to_end(stored.response["id"])
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is not None:
                self._entries.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
