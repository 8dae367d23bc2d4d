"""Incremental detokenisation with stop strings held back.

Text is released token by token through the tokenizers library's ``DecodeStream``, which keeps an unfinished
UTF-8 character (a byte-level token that is half of "é" or an emoji) until the bytes that complete it arrive.
On top of that, any tail that could still grow into a stop string is held back, so a stop string is never
emitted, even when it is split across tokens; when one completes, the text before it is released and the
choice ends. Joined, the released pieces are exactly the completion.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop_strings: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop_strings = tuple(s for s in stop_strings if s)
        self._pending = ""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one token; return the text it releases and whether a stop string completed."""
        self._pending += self._stream.step(self._tokenizer, token_id) or ""
        if not self._stop_strings:
            released, self._pending = self._pending, ""
            return released, False
        stop_at = _first_stop(self._pending, self._stop_strings)
        if stop_at is not None:
            released, self._pending = self._pending[:stop_at], ""
            return released, True
        keep = _held_suffix_length(self._pending, self._stop_strings)
        cut = len(self._pending) - keep
        released, self._pending = self._pending[:cut], self._pending[cut:]
        return released, False

    def flush(self) -> str:
        """Release whatever is held back (the choice ended for another reason than a stop string)."""
        released, self._pending = self._pending, ""
        return released


def _first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(found) if found else None


def _held_suffix_length(text: str, stop_strings: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stop_strings:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
