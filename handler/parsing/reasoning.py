"""Reasoning models' text conventions: which part of an answer is the model thinking, which is the answer.

Formats (vLLM's ``--reasoning-parser`` names, ``option.reasoning_parser``; ``auto`` detects them from the chat
template):

- ``qwen3``: ``<think> ... </think>`` then the answer. The reasoning is open from the start when the rendered prompt
  ends with ``<think>`` (templates that open it for the model); otherwise it is open only if the output begins with
  ``<think>`` (Qwen3 with ``enable_thinking: false`` gets an empty block in its prompt and answers directly).
- ``deepseek_r1``: the same tags, reasoning open from the start (R1 templates open it, and R1 may omit the tag).
- ``gpt_oss``: harmony messages, ``<|channel|>NAME[ to=functions.F][ <|constrain|>json]<|message|>BODY<|end|>``
  (``<|start|>assistant`` between them): ``analysis`` is reasoning, ``final`` the answer, ``commentary`` with a
  ``to=functions.F`` recipient a tool call (its body the arguments), ``commentary`` without one answer text.

``ReasoningSplitter.push`` takes a choice's text as it arrives and returns ``Piece``s, holding back text that may
be the start of a tag, so a stream's pieces join to exactly the whole text's split. The legacy and completions
schemas return the raw text; only chat splits.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

REASONING = "reasoning"
CONTENT = "content"
TOOL_CALL = "tool_call"
PARSERS = ("deepseek_r1", "qwen3", "gpt_oss")

THINK_START, THINK_END = "<think>", "</think>"
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>", "<|return|>")
_HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)")


@dataclass(frozen=True, slots=True)
class Piece:
    """A stretch of a choice's text: reasoning, answer content, or (gpt-oss) a whole tool call's arguments."""

    kind: str
    text: str
    name: str | None = None  # the function a TOOL_CALL piece calls


def detect_parser(template: str | None, setting: str) -> str | None:
    """The reasoning format: the setting when it names one, none for ``none``, else from the template's markers."""
    if setting == "none":
        return None
    if setting != "auto":
        return setting
    if not template:
        return None
    if "<|channel|>" in template:
        return "gpt_oss"
    return "qwen3" if THINK_END in template else None


def marker_texts(parser: str | None) -> tuple[str, ...]:
    """The markers whose text must stay in the output for the split (kept when they are special tokens)."""
    if parser is None:
        return ()
    return HARMONY_TOKENS if parser == "gpt_oss" else (THINK_START, THINK_END)


def prompt_opens_reasoning(parser: str | None, prompt_text: str) -> bool:
    """Whether the model starts inside its reasoning: its prompt's tail opened it (or the format always does)."""
    if parser == "deepseek_r1":
        return True
    return parser == "qwen3" and prompt_text.rstrip().endswith(THINK_START)


def splitter(parser: str, opened: bool) -> ReasoningSplitter:
    return HarmonySplitter() if parser == "gpt_oss" else ThinkSplitter(opened)


class ReasoningSplitter(ABC):
    """Incremental split of one choice's text (``push`` per delta, ``finish`` at its end): the interface the
    ``<think>`` and harmony splitters implement."""

    in_reasoning: bool = False

    @abstractmethod
    def push(self, text: str) -> list[Piece]:
        """The pieces ``text`` completes (a possible marker's start is held until the next delta)."""

    @abstractmethod
    def finish(self) -> list[Piece]:
        """What is still held, at the choice's end."""


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may begin one of ``markers`` (held until the next delta)."""
    for size in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


class ThinkSplitter(ReasoningSplitter):
    """``<think> ... </think>`` then the answer; the answer's leading whitespace is dropped."""

    def __init__(self, opened: bool) -> None:
        self._state = REASONING if opened else "undecided"
        self._buffer = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == REASONING

    def push(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return [p for p in pieces if p.text]

    def _step(self, pieces: list[Piece]) -> bool:
        """One move of the state machine; False when it waits for more text."""
        if self._state == "undecided":
            head = self._buffer.lstrip()
            if head.startswith(THINK_START):
                self._buffer, self._state = head[len(THINK_START):], REASONING
                return True
            if THINK_START.startswith(head):
                return False
            self._state = CONTENT
            return True
        if self._state == REASONING:
            return self._reasoning(pieces)
        if self._state == "answer_start":
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._state = CONTENT
        pieces.append(Piece(CONTENT, self._buffer))
        self._buffer = ""
        return False

    def _reasoning(self, pieces: list[Piece]) -> bool:
        end = self._buffer.find(THINK_END)
        if end >= 0:
            pieces.append(Piece(REASONING, self._buffer[:end]))
            self._buffer, self._state = self._buffer[end + len(THINK_END):], "answer_start"
            return True
        keep = _held(self._buffer, (THINK_END,))
        pieces.append(Piece(REASONING, self._buffer[:len(self._buffer) - keep]))
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def finish(self) -> list[Piece]:
        kind = REASONING if self._state == REASONING else CONTENT
        text, self._buffer = self._buffer, ""
        if self._state == "answer_start":
            text = text.lstrip()
        return [Piece(kind, text)] if text else []


class HarmonySplitter(ReasoningSplitter):
    """gpt-oss's harmony messages (see the module docstring); text outside any message is answer content."""

    def __init__(self) -> None:
        self._buffer = ""
        self._header: str | None = ""   # None: inside a message's body
        self._kind = CONTENT
        self._name: str | None = None
        self._call = ""

    @property
    def in_reasoning(self) -> bool:
        return self._header is None and self._kind == REASONING

    def push(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return [p for p in pieces if p.text or p.kind == TOOL_CALL]

    def _step(self, pieces: list[Piece]) -> bool:
        if self._header is not None:
            return self._read_header(pieces)
        ends = [(self._buffer.find(m), m) for m in _HARMONY_ENDS if m in self._buffer]
        if not ends:
            keep = _held(self._buffer, _HARMONY_ENDS)
            self._body(pieces, self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        at, marker = min(ends)
        self._body(pieces, self._buffer[:at])
        self._close(pieces)
        self._buffer = self._buffer[at + (0 if marker == "<|start|>" else len(marker)):]
        self._header = ""
        return True

    def _read_header(self, pieces: list[Piece]) -> bool:
        head = self._buffer.lstrip()
        if not head.startswith(("<|start|>", "<|channel|>")):
            if any(m.startswith(head) for m in ("<|start|>", "<|channel|>")):
                return False
            pieces.append(Piece(CONTENT, self._buffer))  # not harmony: plain answer text
            self._buffer = ""
            return False
        at = head.find("<|message|>")
        if at < 0:
            return False
        header, self._buffer = head[:at], head[at + len("<|message|>"):]
        channel = header.split("<|channel|>", 1)[-1].split()[0] if "<|channel|>" in header else ""
        recipient = _RECIPIENT.search(header)
        self._kind = REASONING if channel == "analysis" else TOOL_CALL if recipient else CONTENT
        self._name = recipient.group(1) if recipient else None
        self._header, self._call = None, ""
        return True

    def _body(self, pieces: list[Piece], text: str) -> None:
        if self._kind == TOOL_CALL:
            self._call += text
        elif text:
            pieces.append(Piece(self._kind, text))

    def _close(self, pieces: list[Piece]) -> None:
        if self._kind == TOOL_CALL:
            pieces.append(Piece(TOOL_CALL, self._call.strip(), self._name))
        self._kind, self._call = CONTENT, ""

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        if self._header is None:
            self._body(pieces, self._buffer)
            if self._kind == TOOL_CALL:
                self._close(pieces)
        self._buffer = ""
        return [p for p in pieces if p.text or p.kind == TOOL_CALL]
