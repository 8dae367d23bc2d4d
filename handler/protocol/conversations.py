"""The Conversations API's requests (OpenAI's ``/v1/conversations``: create, update, add items) and the list query
both it and ``GET /v1/responses/{id}/input_items`` take (``after``, ``limit``, ``order``), validated. Items are the
Responses API's input items (``response_items``), kept in the store's form.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from handler.errors import BadRequest
from handler.protocol.response_items import InputItem, kept_item

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
MAX_ITEMS = 20  # OpenAI's bound on the items one request adds


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    if metadata is not None and len(metadata) > 16:
        raise BadRequest(f"metadata has {len(metadata)} keys; at most 16 are allowed", param="metadata")
    return metadata or {}


class ConversationCreate(BaseModel):
    model_config = _STRICT
    items: list[InputItem] | None = Field(None, max_length=MAX_ITEMS)
    metadata: dict[str, str] | None = None

    def kept_items(self) -> list[dict]:
        return [kept_item(item.model_dump(exclude_none=True, by_alias=True)) for item in self.items or ()]


class ConversationUpdate(BaseModel):
    model_config = _STRICT
    metadata: dict[str, str] | None


class ItemsCreate(BaseModel):
    model_config = _STRICT
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS)

    def kept_items(self) -> list[dict]:
        return [kept_item(item.model_dump(exclude_none=True, by_alias=True)) for item in self.items]


class ListQuery(BaseModel):
    """A list's page: the items after the one with id ``after``, at most ``limit``, in ``order`` (``desc``: the
    newest first)."""

    model_config = ConfigDict(extra="ignore")   # include and what else a query string carries
    after: str | None = None
    limit: int = Field(20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"

    def page(self, items: list[dict]) -> tuple[list[dict], bool]:
        """The page of ``items`` (oldest first), and whether more follow it."""
        ordered = items if self.order == "asc" else items[::-1]
        start = 0
        if self.after is not None:
            ids = [item["id"] for item in ordered]
            if self.after not in ids:
                raise BadRequest(f"no item with id {self.after!r} is in this list", param="after")
            start = ids.index(self.after) + 1
        return ordered[start:start + self.limit], start + self.limit < len(ordered)
