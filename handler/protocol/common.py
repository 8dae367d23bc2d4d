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
        first = error.errors()[0]
        field = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
        if first["type"] == "extra_forbidden":
            raise BadRequest(f"unknown field '{field}': this server does not support it", param=field) from None
        raise BadRequest(f"invalid '{field}': {first['msg']}", param=field or None) from None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)

