"""What outlives a request and is shared by the server's workers: stored responses and their background runs,
conversations, and the key reasoning items are sealed with (``Store``, opened once per worker by the front door)."""

from handler.store.stores import Store, open_store

__all__ = ["Store", "open_store"]
