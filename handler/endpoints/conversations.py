"""OpenAI's Conversations API: ``/v1/conversations`` (create), ``/v1/conversations/{id}`` (get, update its
metadata, delete), and its items (``/items``: list a page, add; ``/items/{item_id}``: get, delete). A response
given ``conversation`` (``endpoints.responses``) starts from its items and adds its input and output to them.

Conversations live in the store the workers share (``handler.store``), beside stored responses, bounded by the same
``option.responses_store_size`` (counted apart). Items are kept in the Responses input items' stored form (each with
an ``id``; a message's content a list of parts).
"""

from __future__ import annotations

import uuid

from flask import Response

from handler.endpoints.base import Call, Endpoint, answers, json_response
from handler.errors import BadRequest, NotFound
from handler.formatting.conversations import conversation_deleted, item_list
from handler.protocol.common import parse_model
from handler.protocol.conversations import (
    ConversationCreate,
    ConversationUpdate,
    ItemsCreate,
    ListQuery,
    check_metadata,
)
from handler.store.conversations import ConversationStore


class Conversations(Endpoint):
    @property
    def conversations(self) -> ConversationStore:
        return self.door.store.conversations

    @answers
    def create(self, call: Call) -> Response:
        body = parse_model(ConversationCreate, call.json())
        if self.conversations.capacity == 0:
            raise BadRequest("this server stores no conversations (option.responses_store_size=0)", param=None)
        conversation_id = f"conv_{uuid.uuid4().hex}"
        return json_response(self.conversations.create(conversation_id, check_metadata(body.metadata),
                                                       body.kept_items()))

    @answers
    def get(self, call: Call, conversation_id: str) -> Response:
        found = self.conversations.get(conversation_id)
        if found is None:
            raise _unknown(conversation_id)
        return json_response(found)

    @answers
    def update(self, call: Call, conversation_id: str) -> Response:
        body = parse_model(ConversationUpdate, call.json())
        found = self.conversations.update(conversation_id, check_metadata(body.metadata))
        if found is None:
            raise _unknown(conversation_id)
        return json_response(found)

    @answers
    def delete(self, call: Call, conversation_id: str) -> Response:
        if not self.conversations.delete(conversation_id):
            raise _unknown(conversation_id)
        return json_response(conversation_deleted(conversation_id))

    @answers
    def list_items(self, call: Call, conversation_id: str) -> Response:
        query = parse_model(ListQuery, dict(call.query))
        page, has_more = query.page(self._items(conversation_id))
        return json_response(item_list(page, has_more))

    @answers
    def add_items(self, call: Call, conversation_id: str) -> Response:
        items = parse_model(ItemsCreate, call.json()).kept_items()
        if not self.conversations.add_items(conversation_id, items):
            raise _unknown(conversation_id)
        return json_response(item_list(items, False))

    @answers
    def get_item(self, call: Call, conversation_id: str, item_id: str) -> Response:
        for item in self._items(conversation_id):
            if item["id"] == item_id:
                return json_response(item)
        raise NotFound(f"no item with id '{item_id}' in conversation '{conversation_id}'", param="item_id",
                       code="item_not_found")

    @answers
    def delete_item(self, call: Call, conversation_id: str, item_id: str) -> Response:
        """OpenAI answers with the conversation the item was removed from."""
        removed = self.conversations.delete_item(conversation_id, item_id)
        if removed is None:
            raise _unknown(conversation_id)
        if not removed:
            raise NotFound(f"no item with id '{item_id}' in conversation '{conversation_id}'", param="item_id",
                           code="item_not_found")
        return json_response(self.conversations.get(conversation_id))

    def _items(self, conversation_id: str) -> list[dict]:
        items = self.conversations.items(conversation_id)
        if items is None:
            raise _unknown(conversation_id)
        return items


def _unknown(conversation_id: str) -> NotFound:
    return NotFound(f"no conversation with id '{conversation_id}'", param="conversation_id",
                    code="conversation_not_found")
