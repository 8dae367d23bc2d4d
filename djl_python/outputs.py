"""LMI's ``djl_python.outputs``: the server's ``Output`` with LMI's streaming default.

LMI's ``add_stream_content(stream, output_formatter=...)`` wraps each item in ``{"outputs": item}`` and a newline
unless the handler passes its own formatter or ``None`` (items sent as they are). ``handler.djl.Output`` sends
items as they are by default (its handlers frame their own lines), so only this subclass differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from handler.djl import Output as _ServerOutput
from handler.djl.types import encode_json


def default_stream_formatter(token_texts: object) -> bytes:
    """LMI's default stream record: one JSON line ``{"outputs": ...}`` per item the generator yields."""
    return encode_json({"outputs": token_texts}) + b"\n"


class Output(_ServerOutput):
    """``handler.djl.Output`` with LMI's ``add_stream_content`` signature and default."""

    def add_stream_content(self, stream_content: Iterable[object],  # type: ignore[override]
                           output_formatter: Callable[[object], object] | None = default_stream_formatter,
                           content_type: str = "application/jsonlines") -> Output:
        super().add_stream_content(stream_content, content_type, formatter=output_formatter)
        return self


__all__ = ["Output"]
