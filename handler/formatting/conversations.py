"""The Conversations API's answers, and the item lists it shares with ``GET /v1/responses/{id}/input_items``
(OpenAI's ``list`` object: ``data``, ``first_id``, ``last_id``, ``has_more``)."""

from __future__ import annotations


def item_list(items: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def conversation_deleted(conversation_id: str) -> dict:
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}
