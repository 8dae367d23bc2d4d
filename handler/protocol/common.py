"""What both schemas share: validation errors that name the field, and request ids."""

from __future__ import annotations

import uuid
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from handler.errors import BadRequest

Model = TypeVar("Model", bound=BaseModel)


def parse_model(model: type[Model], body: object, prefix: str = "") -> Model:
    """Validate a JSON body; a failure becomes a 400 naming the first offending field and why."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", param=None)
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = max(error.errors(), key=lambda e: len(e["loc"]))  # the most specific of a union's attempts
        field = prefix + field_path(first["loc"])
        if first["type"] == "extra_forbidden":
            raise BadRequest(f"unknown field '{field}': this server does not support it", param=field) from None
        raise BadRequest(f"invalid '{field}': {first['msg']}", param=field or None) from None


def field_path(loc: tuple) -> str:
    """``("messages", 0, "content", "list[...]", 1, "image_url", "image_url", "detail")`` ->
    ``messages[0].content[1].image_url.detail``: pydantic's union-member tags dropped, field names kept."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif not _is_union_tag(item) and (not parts or parts[-1] != f".{item}"):
            parts.append(f".{item}")
    return "".join(parts).lstrip(".")


def _is_union_tag(item: str) -> bool:
    return "[" in item or item.startswith("function-") or item in {"str", "int", "float", "bool", "none"}


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)

