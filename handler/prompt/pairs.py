"""Texts as rerank and score read them: a query and a document together, as a cross-encoder's tokenizer pairs them
(``[CLS] query [SEP] document [SEP]`` with token types, or ``<s> query </s></s> document </s>``), or each alone, as
an embedding model reads it; cut to fit when the request asks.

What a request may ask to cut: the pair to a length (TEI's ``truncate``, longest first, from the side its
``truncation_direction`` names: the ``tokenizers`` library's own rule, which TEI runs), or the document to a number
of tokens (``max_tokens_per_doc``, Cohere's and vLLM's: the document alone is cut, as vLLM cuts it). Without either,
nothing is cut, and an input longer than the context is refused by the engine, naming it.

The tokenizer here is a private copy of the folder's fast tokenizer: truncation is a setting of a ``tokenizers``
object, and the one the rest of the server shares must not change under another thread's request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from handler.engine.types import TokenPair
from handler.errors import BadRequest


@dataclass(frozen=True, slots=True)
class Cut:
    """What to cut: the whole input to ``fit`` tokens (longest part first, for a pair), or a document (the second
    text) to ``doc_tokens`` tokens of its own; ``side``: ``right`` keeps the start, ``left`` the end."""

    fit: int | None = None
    doc_tokens: int | None = None
    side: str = "right"


NO_CUT = Cut()


class PairTokenizer:
    """A copy of the folder's fast tokenizer for pairs and single texts under a ``Cut``; thread-safe."""

    def __init__(self, tokenizer) -> None:
        from tokenizers import Tokenizer

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} has no fast tokenizer (tokenizer.json) to pair texts with")
        self._tokenizer = Tokenizer.from_str(backend.to_str())
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        # BERT's tokenizers give the second text token type 1; RoBERTa's give none (the model has one type)
        self._has_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        self._lock = threading.Lock()

    def pair(self, first: str, second: str, cut: Cut = NO_CUT, param: str = "documents") -> TokenPair:
        """``first`` and ``second`` as one input, the tokenizer's special tokens and separators in."""
        with self._lock:
            try:
                if cut.doc_tokens is not None:
                    self._cut(len(self._tokenizer.encode(first, add_special_tokens=False).ids) + cut.doc_tokens
                              + self._specials(pair=True), "only_second", cut.side)
                elif cut.fit is not None:
                    self._cut(cut.fit, "longest_first", cut.side)
                encoding = self._tokenizer.encode(first, second, add_special_tokens=True)
            except Exception as error:  # tokenizers' truncation errors (a budget the special tokens exceed)
                raise BadRequest(f"the pair cannot be cut to fit: {error}", param=param) from None
            finally:
                self._tokenizer.no_truncation()
        ids = tuple(encoding.ids)
        types = encoding.type_ids
        second_start = types.index(1) if self._has_types and 1 in types else len(ids)
        return TokenPair(ids, second_start)

    def single(self, text: str, cut: Cut = NO_CUT, is_doc: bool = False, param: str = "documents") -> tuple[int, ...]:
        """``text`` alone, with the tokenizer's special tokens (an embedding model's input); a document cut to
        ``cut.doc_tokens`` tokens of its own, or any text to ``cut.fit``."""
        with self._lock:
            try:
                if cut.doc_tokens is not None and is_doc:
                    self._cut(cut.doc_tokens + self._specials(pair=False), "longest_first", cut.side)
                elif cut.fit is not None:
                    self._cut(cut.fit, "longest_first", cut.side)
                return tuple(self._tokenizer.encode(text, add_special_tokens=True).ids)
            except Exception as error:
                raise BadRequest(f"the text cannot be cut to fit: {error}", param=param) from None
            finally:
                self._tokenizer.no_truncation()

    def _cut(self, max_length: int, strategy: str, side: str) -> None:
        self._tokenizer.enable_truncation(max_length, strategy=strategy, direction=side)

    def _specials(self, pair: bool) -> int:
        processor = self._tokenizer.post_processor
        return 0 if processor is None else processor.num_special_tokens_to_add(pair)
