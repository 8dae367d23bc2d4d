"""Framings: how a sequence of JSON records goes on the wire.

JSON lines (LMI's default on /invocations): one self-contained object per line, each ending in ``\\n``, so a
client that receives SageMaker PayloadParts cut anywhere can buffer and split on newlines.
Server-sent events (what the OpenAI SDK reads): ``data: {...}\\n\\n`` frames, ending with ``data: [DONE]``.
Typed server-sent events (OpenAI's Responses stream): ``event: <type>\\ndata: {...}\\n\\n`` frames, each record's
``type`` as its event name, and no ``[DONE]`` (the last event says the response is over).
TGI's server-sent events: ``data: {...}\\n\\n`` frames and no ``[DONE]`` (TGI's ``text_generation`` client
decodes every ``data:`` line as JSON; the last record carries ``generated_text``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

JSONLINES_MIMETYPE = "application/jsonlines"
SSE_MIMETYPE = "text/event-stream"


def dumps(record: object) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


def jsonlines(records: Iterable[dict]) -> Iterator[bytes]:
    for record in records:
        yield (dumps(record) + "\n").encode("utf-8")


def sse(records: Iterable[dict]) -> Iterator[bytes]:
    for record in records:
        yield f"data: {dumps(record)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def tgi_sse(records: Iterable[dict]) -> Iterator[bytes]:
    for record in records:
        yield f"data: {dumps(record)}\n\n".encode()


def typed_sse(records: Iterable[dict]) -> Iterator[bytes]:
    for record in records:
        yield f"event: {record['type']}\ndata: {dumps(record)}\n\n".encode()


FRAMINGS = {"jsonlines": (jsonlines, JSONLINES_MIMETYPE), "sse": (sse, SSE_MIMETYPE),
            "typed_sse": (typed_sse, SSE_MIMETYPE), "tgi_sse": (tgi_sse, SSE_MIMETYPE)}
