"""Incremental detokenisation with stop strings held back.

Text is released token by token through the tokenizers library's ``DecodeStream``, which keeps an unfinished
UTF-8 character (a byte-level token that is half of "é" or an emoji) until the bytes that complete it arrive.
On top of that, any tail that could still grow into a stop string is held back, so a stop string is never
emitted, even when it is split across tokens; when one completes, the text before it is released (and the stop
string itself with ``include_stop``) and the choice ends. Joined, the released pieces are exactly the completion.

Special tokens' text is left out unless the request keeps it (``TextOptions.skip_special_tokens`` false, or a
token among ``keep_ids``: a tool-call marker); with ``spaces_between_special_tokens`` a kept special token is set
apart from the text beside it by a space, as transformers' slow tokenizers join them.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from handler.engine.types import TextOptions

PLAIN_TEXT = TextOptions()


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop_strings: tuple[str, ...] = (), *, include_stop: bool = False,
                 options: TextOptions = PLAIN_TEXT, special_ids: frozenset[int] = frozenset(),
                 keep_ids: tuple[int, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=options.skip_special_tokens)
        self._stop_strings = tuple(s for s in stop_strings if s)
        self._include_stop = include_stop
        self._skip_special = options.skip_special_tokens
        self._spaced = options.spaces_between_special_tokens and not options.skip_special_tokens
        self._special_ids = special_ids
        self._keep_ids = frozenset(keep_ids) if options.skip_special_tokens else frozenset()
        self._pending = ""
        self._tail = ""              # with include_stop: the released text's last characters, where a stop may begin
        self._lookback = max((len(stop) - 1 for stop in self._stop_strings), default=0)
        self._released_any = False   # for spacing: has any text come out yet
        self._after_special = False  # for spacing: the last token with text was a special one

    def push(self, token_id: int, *, stops_count: bool = True) -> tuple[str, bool]:
        """Add one token; return the text it releases and whether a stop string completed. With ``stops_count``
        false (``min_tokens`` not reached yet) stop strings are not looked for and nothing is held back."""
        self._pending += self._piece(token_id)
        if not self._stop_strings or not stops_count:
            return self._release(len(self._pending)), False
        if self._include_stop:
            return self._push_included()
        stop_at = _first_stop(self._pending, self._stop_strings)
        if stop_at is not None:
            released = self._release(stop_at)
            self._pending = ""
            return released, True
        return self._release(len(self._pending) - _held_suffix_length(self._pending, self._stop_strings)), False

    def _push_included(self) -> tuple[str, bool]:
        """The stop string will be shown whole, so nothing is held back; a stop string that began in text already
        released is found in the released tail kept for the purpose."""
        tail = self._tail
        end = _first_stop_end(tail + self._pending, self._stop_strings, len(tail))
        if end is None:
            return self._release(len(self._pending)), False
        released = self._release(end - len(tail))
        self._pending = ""
        return released, True

    def flush(self) -> str:
        """Release whatever is held back (the choice ended for another reason than a stop string)."""
        return self._release(len(self._pending))

    def _piece(self, token_id: int) -> str:
        text = self._stream.step(self._tokenizer, token_id) or ""
        if token_id in self._keep_ids:  # the stream skipped it: a kept marker's text is added as the token's own
            text += self._tokenizer.id_to_token(token_id) or ""
        if not self._spaced or not text:
            return text
        is_special = token_id in self._special_ids
        spaced = " " + text if self._released_any_or_pending and (is_special or self._after_special) else text
        self._after_special = is_special
        return spaced

    @property
    def _released_any_or_pending(self) -> bool:
        return self._released_any or bool(self._pending)

    def _release(self, end: int) -> str:
        released, self._pending = self._pending[:end], self._pending[end:]
        self._released_any = self._released_any or bool(released)
        if self._include_stop and self._lookback:
            self._tail = (self._tail + released)[-self._lookback:]
        return released


def _first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(found) if found else None


def _first_stop_end(text: str, stop_strings: tuple[str, ...], new_from: int) -> int | None:
    """Where the first stop string that ends in ``text[new_from:]`` ends (the earliest start; the longest of those
    starting there), or None."""
    found = []
    for stop in stop_strings:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start >= 0:
            found.append((start, -len(stop)))
    if not found:
        return None
    start, minus_length = min(found)
    return start - minus_length


def _held_suffix_length(text: str, stop_strings: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stop_strings:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
