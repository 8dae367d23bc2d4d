"""Tool calls read out of a model's output, whole or as it streams, in the dialect the model speaks (``dialects``).

Each call unit (a hermes block, a JSON value) is decided alone when it closes: a valid call becomes a
``ToolCall``, anything else stays content, verbatim. So a streamed call is never taken back, and the stream
(``ToolCallStream``) and ``parse_tool_calls`` (the stream run once) agree at every split. Content is the text
outside calls, ends stripped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from handler.parsing.dialects import FORMATS, PYTHON_TAG, ToolCall, check_format

_JSON_CLOSERS = "]}"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # Python's json would take NaN / Infinity


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    """A whole completion, split into its text and its calls."""

    content: str | None  # None when empty and there are calls
    calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Streamed text that is no part of a call."""

    text: str


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A streamed call, whole; ``index`` counts the calls of the choice from 0."""

    index: int
    call: ToolCall


Delta = ContentDelta | CallDelta


def _decode(text: str) -> object:
    """The JSON value of ``text``, or None where it is not JSON (deep nesting included)."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        return None


def _call_from_object(obj: object, new_id: Callable[[], str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        arguments = _decode(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":")), new_id())


def _calls_from_value(value: object, new_id: Callable[[], str]) -> list[ToolCall] | None:
    """The calls of one JSON value (an object, or a list of them), or None unless every item is a call."""
    items = value if isinstance(value, list) else [value]
    calls = [call for call in (_call_from_object(item, new_id) for item in items) if call is not None]
    return calls if calls and len(calls) == len(items) else None


def _partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ToolCallStream:
    """Incremental tool-call parser: text deltas in, content deltas and whole calls out.

    Content is released as soon as it cannot start a call (a tail like ``<tool_`` waits until decided);
    whitespace is held until text follows it, so the joined content comes out stripped, as
    ``parse_tool_calls`` gives it. A call is released when its unit closes (``</tool_call>``, the end of the
    JSON value) or at ``finish()``, where whatever is undecided becomes content: nothing is lost.

    ``calls_only``: the output was forced to be calls (tool_choice required or named), so nothing is content;
    what is left at ``finish()`` is a call that ``max_tokens`` cut off, and it is dropped rather than shown as
    markup (``finish_reason`` is ``length`` then).
    """

    def __init__(self, fmt: str, *, calls_only: bool = False) -> None:
        self._format = FORMATS[check_format(fmt)]
        self._calls_only = calls_only
        self._buffer = ""  # text not yet released
        self._prefix = ""  # text consumed before the current unit; content again if the unit is no call
        self._scanned = 0  # JSON units: no complete value in the buffer up to here
        self._state: Callable[[bool], bool] = self._at_start if self._format.calls_at_start else self._in_text
        self._out: list[Delta] = []
        self._num_calls = 0
        self._has_content = False
        self._held_space = ""

    def push(self, text: str) -> list[Delta]:
        """Add generated text; return what it releases."""
        self._buffer += text
        while self._state(False):
            pass
        return self._drain()

    def finish(self) -> list[Delta]:
        """The generation ended: decide everything held back and return it."""
        while self._state(True):
            pass
        return self._drain()

    # Each state handles the buffer and returns whether it moved on to another state (then it runs again).

    def _in_text(self, final: bool) -> bool:
        opener = self._format.opener
        at = -1 if self._format.calls_at_start else self._buffer.find(opener)
        if at < 0:
            keep = 0 if final or self._format.calls_at_start else _partial_marker_length(self._buffer, opener)
            cut = len(self._buffer) - keep
            self._content(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            return False
        self._content(self._buffer[:at])
        self._prefix, self._buffer = opener, self._buffer[at + len(opener) :]
        self._state = self._in_block if self._format.closer else self._in_json
        return True

    def _in_block(self, final: bool) -> bool:
        closer = self._format.closer or ""
        end = self._buffer.find(closer)
        if end < 0 and not final:
            return False
        body, self._buffer = (self._buffer, "") if end < 0 else (self._buffer[:end], self._buffer[end + len(closer) :])
        # An unclosed block at the end still counts when it holds a whole call (generation stopped at the tag).
        self._unit(_decode(body.strip()), self._prefix + body + (closer if end >= 0 else ""))
        self._state = self._in_text
        return True

    def _in_json(self, final: bool) -> bool:
        decoded = self._decode_unit(final)
        if decoded is None:
            return False
        value, end = decoded
        raw, self._buffer = self._prefix + self._buffer[:end], self._buffer[end:]
        self._scanned = 0
        is_call = self._unit(value, raw)
        self._state = self._after_call if is_call and self._format.calls_at_start else self._in_text
        return True

    def _decode_unit(self, final: bool) -> tuple[object, int] | None:
        """(value, end) of the JSON value that opens the buffer, (None, end) if there is none, None to wait."""
        text = self._buffer
        start = len(text) - len(text.lstrip())
        if start == len(text):
            return (None, start) if final else None
        if text[start] not in "[{":
            return None, 0
        # A container value can only end on ] or }: wait for one before decoding again.
        if not final and not any(c in _JSON_CLOSERS for c in text[self._scanned :]):
            return None
        try:
            return _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            self._scanned = len(text)
            return (None, len(text)) if final else None

    def _at_start(self, final: bool) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(head) and not final:
            return False  # nothing yet, or a part of the tag: undecided
        if not head and not final:
            return False
        if head.startswith("{"):
            self._prefix, self._buffer = self._buffer[: len(self._buffer) - len(head)], head
            self._state = self._in_json
        else:
            self._state = self._in_text
        return True

    def _after_call(self, final: bool) -> bool:
        rest = self._buffer.lstrip().removeprefix(";").lstrip()
        if not rest:
            if final:
                self._buffer = ""  # a dangling separator is no content
            return False
        if rest.startswith("{"):
            self._prefix, self._buffer = self._buffer[: len(self._buffer) - len(rest)], rest
            self._state = self._in_json
        else:
            self._state = self._in_text
        return True

    def _unit(self, value: object, raw: str) -> bool:
        """Release one closed unit: its calls, or its raw text as content. Returns whether it was calls."""
        calls = _calls_from_value(value, self._format.new_id)
        if calls is None:
            self._content(raw)
            return False
        for call in calls:
            self._out.append(CallDelta(self._num_calls, call))
            self._num_calls += 1
        return True

    def _content(self, text: str) -> None:
        if self._calls_only:
            return
        text = self._held_space + text if self._has_content else text.lstrip()
        body = text.rstrip()
        self._held_space = text[len(body) :]
        if body:
            self._out.append(ContentDelta(body))
            self._has_content = True

    def _drain(self) -> list[Delta]:
        merged: list[Delta] = []
        for delta in self._out:
            if merged and isinstance(delta, ContentDelta) and isinstance(merged[-1], ContentDelta):
                merged[-1] = ContentDelta(merged[-1].text + delta.text)
            else:
                merged.append(delta)
        self._out = []
        return merged


def parse_tool_calls(text: str, fmt: str, *, calls_only: bool = False) -> ParsedMessage:
    """Split a whole completion into content and calls; never raises on model output (ValueError on ``fmt``)."""
    stream = ToolCallStream(fmt, calls_only=calls_only)
    deltas = stream.push(text) + stream.finish()
    calls = [d.call for d in deltas if isinstance(d, CallDelta)]
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    return ParsedMessage(content or (None if calls or calls_only else ""), calls)
