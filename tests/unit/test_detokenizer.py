"""Incremental detokenisation with the embedded model's real byte-level BPE tokenizer, and stop-string hold-back."""

from __future__ import annotations

from pathlib import Path

import pytest

from handler.config import DEFAULT_MODEL_DIR
from handler.engine.core.detokenizer import IncrementalDetokenizer

SENTENCE = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def hf_tokenizer():
    if not (DEFAULT_MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("the embedded model is not assembled (make model)")
    from handler.engine.core.tokenizer import load_tokenizer

    return load_tokenizer(Path(DEFAULT_MODEL_DIR))


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer):
    return hf_tokenizer.backend_tokenizer


def encode(hf_tokenizer, text: str) -> list[int]:
    return hf_tokenizer.encode(text, add_special_tokens=False)


def run(tokenizer, ids: list[int], stops: tuple[str, ...] = ()) -> tuple[list[str], bool, str]:
    """Push every token until a stop string completes; returns the pieces, whether one did, and flush()."""
    detok = IncrementalDetokenizer(tokenizer, stops)
    pieces = []
    for token_id in ids:
        piece, stopped = detok.push(token_id)
        pieces.append(piece)
        if stopped:
            return pieces, True, ""
    return pieces, False, detok.flush()


# ---- multi-byte text ------------------------------------------------------------------------------------------

MULTIBYTE = [
    "Café au lait, crème brûlée.",
    "日本語のテキスト",
    "Hi 😀 there 🎉!",
    " leading space and trailing space ",
    "mixed: naïve 日本 😀😀 €100\nnew line",
]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_streamed_pieces_join_to_decode(hf_tokenizer, tokenizer, text: str) -> None:
    ids = encode(hf_tokenizer, text)
    pieces, stopped, tail = run(tokenizer, ids)
    assert not stopped
    assert "".join(pieces) + tail == hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_emoji_split_across_byte_tokens_is_held_until_complete(hf_tokenizer, tokenizer) -> None:
    ids = encode(hf_tokenizer, "Hi 😀")
    assert len(ids) == 3  # "Hi", " <first bytes of the emoji>", "<last byte>": the emoji spans two tokens
    pieces, _, tail = run(tokenizer, ids)
    assert pieces == ["Hi", "", " 😀"]
    assert tail == ""


def test_cjk_character_split_across_tokens(hf_tokenizer, tokenizer) -> None:
    ids = encode(hf_tokenizer, "日本")
    pieces, _, _ = run(tokenizer, ids)
    assert pieces[0] == ""            # half of 日
    assert "".join(pieces) == "日本"


def test_special_tokens_are_skipped(hf_tokenizer, tokenizer) -> None:
    ids = encode(hf_tokenizer, "<|im_start|>assistant\nHello<|im_end|>")
    assert ids[0] == hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    pieces, _, tail = run(tokenizer, ids)
    assert "".join(pieces) + tail == hf_tokenizer.decode(ids, skip_special_tokens=True) == "assistant\nHello"
    assert pieces[-1] == ""


# ---- stop strings ---------------------------------------------------------------------------------------------

def test_stop_string_spanning_a_token_boundary(hf_tokenizer, tokenizer) -> None:
    ids = encode(hf_tokenizer, SENTENCE)
    assert hf_tokenizer.convert_ids_to_tokens(ids[1:3]) == ["Ġquick", "Ġbrown"]
    pieces, stopped, _ = run(tokenizer, ids, ("ck bro",))  # end of " quick" + start of " brown"
    assert stopped
    assert pieces == ["The", " qui", ""]  # "ck" held back after " quick", then dropped with the stop


def _substrings(text: str) -> list[str]:
    return sorted({text[i:i + n] for n in (1, 2, 3, 5, 8) for i in range(len(text) - n + 1)})


@pytest.mark.parametrize("text", [SENTENCE, "Hi 😀 there, café 日本語!"])
def test_no_stop_string_is_ever_emitted(hf_tokenizer, tokenizer, text: str) -> None:
    ids = encode(hf_tokenizer, text)
    for stop in _substrings(text):
        pieces, stopped, tail = run(tokenizer, ids, (stop,))
        assert stopped, stop
        assert tail == ""
        assert "".join(pieces) == text[: text.find(stop)], stop
        assert all("\ufffd" not in piece for piece in pieces)


def test_held_back_text_is_released_by_flush(hf_tokenizer, tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy"
    ids = encode(hf_tokenizer, text)
    pieces, stopped, tail = run(tokenizer, ids, (" lazy cat",))
    assert not stopped
    assert pieces[-1] == ""          # " lazy" could still become " lazy cat"
    assert tail == " lazy"
    assert "".join(pieces) + tail == text


def test_flush_empties_the_buffer(hf_tokenizer, tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, ("abc",))
    assert detok.push(encode(hf_tokenizer, "ab")[0]) == ("", False)
    assert detok.flush() == "ab"
    assert detok.flush() == ""


def test_prefix_that_diverges_is_released(hf_tokenizer, tokenizer) -> None:
    ids = encode(hf_tokenizer, SENTENCE)
    pieces, stopped, tail = run(tokenizer, ids, ("quick red",))
    assert not stopped
    assert pieces[:4] == ["The", " ", "quick brown", " fox"]
    assert "".join(pieces) + tail == SENTENCE


@pytest.mark.parametrize(("stops", "expected"), [
    (("dog", "fox"), "The quick brown "),                 # completes first in the text
    (("fox", "dog"), "The quick brown "),
    (("mp", "ju"), "The quick brown fox "),               # both complete in the same token: earliest start wins
    (("ps over", "jumps"), "The quick brown fox "),
    (("k brown fox", "brown"), "The quick "),              # a shorter one inside a longer one's span
    (("zebra", "lazy"), "The quick brown fox jumps over the "),
])
def test_multiple_stop_strings_earliest_wins(hf_tokenizer, tokenizer, stops: tuple[str, ...], expected: str) -> None:
    pieces, stopped, _ = run(tokenizer, encode(hf_tokenizer, SENTENCE), stops)
    assert stopped
    assert "".join(pieces) == expected


def test_empty_stop_strings_are_ignored(hf_tokenizer, tokenizer) -> None:
    ids = encode(hf_tokenizer, SENTENCE)
    pieces, stopped, tail = run(tokenizer, ids, ("",))
    assert not stopped
    assert "".join(pieces) + tail == SENTENCE
    assert pieces[0] == "The"  # nothing held back


def test_multibyte_stop_string(hf_tokenizer, tokenizer) -> None:
    text = "Hi 😀 there 🎉!"
    pieces, stopped, _ = run(tokenizer, encode(hf_tokenizer, text), ("🎉",))
    assert stopped
    assert "".join(pieces) == "Hi 😀 there "


# ---- include_stop_str_in_output, min_tokens, special tokens ---------------------------------------------------

def test_included_stop_string_ends_the_text_and_nothing_is_held_back(hf_tokenizer, tokenizer) -> None:
    ids = encode(hf_tokenizer, SENTENCE)
    detok = IncrementalDetokenizer(tokenizer, ("ck bro",), include_stop=True)
    pieces = [detok.push(token_id) for token_id in ids[:3]]
    assert pieces == [("The", False), (" quick", False), (" bro", True)]  # " brown" cut after the stop string


@pytest.mark.parametrize("text", [SENTENCE, "Hi 😀 there, café 日本語!"])
def test_included_stop_string_is_the_texts_end(hf_tokenizer, tokenizer, text: str) -> None:
    ids = encode(hf_tokenizer, text)
    for stop in _substrings(text):
        detok = IncrementalDetokenizer(tokenizer, (stop,), include_stop=True)
        pieces = []
        for token_id in ids:
            piece, stopped = detok.push(token_id)
            pieces.append(piece)
            if stopped:
                break
        assert stopped and "".join(pieces) == text[: text.find(stop) + len(stop)], stop


def test_stops_do_not_count_before_the_minimum(hf_tokenizer, tokenizer) -> None:
    """min_tokens: a stop string in the first tokens is text like any other; counted from the minimum on."""
    ids = encode(hf_tokenizer, "The cat and the cat.")
    detok = IncrementalDetokenizer(tokenizer, (" cat",))
    early = [detok.push(token_id, stops_count=False) for token_id in ids[:2]]
    assert early == [("The", False), (" cat", False)]
    rest = []
    for token_id in ids[2:]:
        rest.append(detok.push(token_id))
        if rest[-1][1]:
            break
    assert rest == [(" and", False), (" the", False), ("", True)]


def test_kept_special_tokens_with_and_without_spaces(hf_tokenizer, tokenizer) -> None:
    from handler.engine.types import TextOptions

    ids = encode(hf_tokenizer, "Hello<|im_end|>world<|im_start|><|im_end|>")
    special = frozenset(hf_tokenizer.all_special_ids)
    joined = {}
    for spaces in (False, True):
        detok = IncrementalDetokenizer(tokenizer, options=TextOptions(skip_special_tokens=False,
                                                                     spaces_between_special_tokens=spaces),
                                       special_ids=special)
        joined[spaces] = "".join(detok.push(token_id)[0] for token_id in ids) + detok.flush()
    assert joined[False] == hf_tokenizer.decode(ids, skip_special_tokens=False) == \
        "Hello<|im_end|>world<|im_start|><|im_end|>"
    assert joined[True] == "Hello <|im_end|> world <|im_start|> <|im_end|>"


def test_a_kept_marker_shows_while_other_special_tokens_are_skipped(hf_tokenizer, tokenizer) -> None:
    ids = encode(hf_tokenizer, "<|im_start|>Hi<|im_end|>")
    marker = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, keep_ids=(marker,))
    assert "".join(detok.push(token_id)[0] for token_id in ids) == "Hi<|im_end|>"
