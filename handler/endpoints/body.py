"""A request's body, read under the server's limits and decoded as the JSON object every API takes.

``read_body`` reads what gunicorn's ``wsgi.input`` holds (Content-Length or chunked), up to the server's limit
(``option.max_request_size``, ``SAGEMAKER_MAX_REQUEST_SIZE``; SageMaker's 6 MiB by default: 413 past it), under the
worker's read deadline (408); broken chunked framing is a 400.
``parse_json`` refuses what JSON parsers would let through but no API can take: NaN and Infinity, lone UTF-16
surrogates, nesting too deep for Python, and anything but an object.

May import: ``handler.errors``, ``handler.formatting.framing`` (its JSON encoder), gunicorn's and werkzeug's errors.
"""

from __future__ import annotations

import json

from gunicorn.http.errors import ParseException
from werkzeug.exceptions import RequestEntityTooLarge

from handler.errors import BadRequest, PayloadTooLarge, RequestTimeout
from handler.formatting.framing import dumps


def too_large(limit: int | None) -> PayloadTooLarge:
    over = f"{limit} bytes" if limit else "the server's limit"
    return PayloadTooLarge(f"the request body is over {over} (option.max_request_size, SAGEMAKER_MAX_REQUEST_SIZE)")


def read_body(request, limit: int) -> bytes:
    """The body of a werkzeug ``request``, up to ``limit`` bytes (413 past it, chunked or not); 400 for broken
    chunked framing, 408 when it does not arrive within ``option.request_read_timeout``."""
    if request.content_length and request.content_length > limit:
        raise too_large(limit)
    # gunicorn's wsgi.input ends where the body ends (Content-Length or chunked); werkzeug's wrapper would stop
    # silently at MAX_CONTENT_LENGTH. Read one byte past the limit, never more: a longer body is a 413.
    environ = request.environ
    stream = environ["wsgi.input"] if environ.get("wsgi.input_terminated") else request.stream
    parts, size = [], 0
    try:
        while size <= limit:
            part = stream.read(limit + 1 - size)
            if not part:
                break
            parts.append(part)
            size += len(part)
    except RequestEntityTooLarge:  # werkzeug's own limit, on a body without a length outside gunicorn
        raise too_large(limit) from None
    except TimeoutError as error:  # the worker's deadline for the whole request (option.request_read_timeout)
        message = str(error) or "the request body did not arrive in time"
        raise RequestTimeout(message, code="request_timeout") from None
    except ParseException as error:  # gunicorn: a malformed chunk size, extension, terminator or trailer
        raise BadRequest(f"the request body's chunked framing is malformed: {type(error).__name__}: {error}",
                         code="bad_request") from None
    except OSError:  # the client closed the connection before the body ended
        raise BadRequest("the request body ended before it was complete") from None
    if size > limit:
        raise too_large(limit)
    return b"".join(parts)


def bounded(raw: bytes, limit: int) -> bytes:
    """A body handed over whole (a user's handler passing its input to ``builtin_handle``), under the same limit."""
    if len(raw) > limit:
        raise too_large(limit)
    return raw


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; a 400 saying what is wrong with it otherwise."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    try:  # JSON's "\ud800" escapes decode to lone surrogates: not text, and they break tokenizers and replies
        dumps(body).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("the request body contains a lone UTF-16 surrogate (invalid Unicode)") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")
