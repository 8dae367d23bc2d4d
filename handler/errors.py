"""Errors that are part of the API, and the one place their bodies are written.

Every failure a client can see is a ``ServingError``: it carries the HTTP status, the OpenAI-style error type,
and the request field it concerns. ``error_record`` writes it in the shape of the route that failed
(``ErrorShape``): OpenAI's ``{"error": {"message", "type", "param", "code"}}``, the legacy schema's, or the last line
of a legacy stream; nothing else reaches the wire.

May import: nothing of the package (every layer imports this one).
"""

from __future__ import annotations

import enum


class ServingError(Exception):
    """A failure with a status code, an error type and (when a field is at fault) the field's name."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class BadRequest(ServingError):
    """400: the request is malformed or a field is out of range."""

    status_code = 400
    error_type = "invalid_request_error"


class Unprocessable(ServingError):
    """422: a well-formed request the model cannot serve (Azure ML's convention)."""

    status_code = 422
    error_type = "invalid_request_error"


class NotFound(ServingError):
    """404: what the request names does not exist (OpenAI: an unknown model is ``model_not_found``)."""

    status_code = 404
    error_type = "invalid_request_error"


class Conflict(ServingError):
    """409: the request clashes with the server's state (an adapter name already registered)."""

    status_code = 409
    error_type = "invalid_request_error"


class PayloadTooLarge(ServingError):
    """413: the body is over the size SageMaker allows."""

    status_code = 413
    error_type = "invalid_request_error"


class RequestTimeout(ServingError):
    """408: the request (line, headers, body) did not arrive within ``option.request_read_timeout``."""

    status_code = 408
    error_type = "invalid_request_error"


class Overloaded(ServingError):
    """429: the wait queue is full; the client should retry later."""

    status_code = 429
    error_type = "rate_limit_error"


class NotReady(ServingError):
    """503: the model is still loading, or the server is shutting down."""

    status_code = 503
    error_type = "service_unavailable"


class GatewayTimeout(ServingError):
    """504: the request ran past ``option.request_timeout`` (waiting for a slot included) and was ended."""

    status_code = 504
    error_type = "timeout_error"


class EngineError(ServingError):
    """500: the model failed while serving a request."""

    status_code = 500
    error_type = "internal_error"


class ConfigError(Exception):
    """A setting is unknown, invalid, or names a model that cannot be loaded. Raised at start only."""


class ErrorShape(enum.Enum):
    """How a route writes its errors; each endpoint answers in one shape."""

    OPENAI = "openai"      # {"error": {"message", "type", "param", "code"}}: OpenAI's routes (a body, a stream's end)
    LEGACY = "legacy"      # {"error", "error_type", "param", "code": status}: the legacy schema's routes (LMI, TGI)
    LMI_LINE = "lmi_line"  # a legacy stream's last line: a token with id -1, ``log_prob`` (LMI's name)
    TGI_LINE = "tgi_line"  # the same in TGI's spelling (``logprob``)

    @classmethod
    def for_path(cls, path: str) -> ErrorShape:
        """The shape of a path no endpoint answered (no such route, or a request refused before routing)."""
        return cls.OPENAI if path.startswith("/v1/") else cls.LEGACY


def error_record(error: ServingError, shape: ErrorShape, *, num_generated_tokens: int = 0) -> dict:
    """``error`` written in ``shape``; a legacy stream's line counts the tokens generated before it failed."""
    if shape is ErrorShape.OPENAI:
        return {"error": {"message": error.message, "type": error.error_type, "param": error.param,
                          "code": error.code}}
    if shape is ErrorShape.LEGACY:
        return {"error": error.message, "error_type": error.error_type, "param": error.param,
                "code": error.status_code}
    logprob_key = "logprob" if shape is ErrorShape.TGI_LINE else "log_prob"
    return {"token": {"id": -1, "text": "", logprob_key: None, "special": True}, "generated_text": None,
            "details": {"finish_reason": "error", "generated_tokens": num_generated_tokens}, "error": error.message}
