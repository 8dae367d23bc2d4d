"""Rerank and score requests: TEI's ``/rerank``, the Cohere / Jina shape vLLM serves on ``/rerank``, ``/v1/rerank``
and ``/v2/rerank``, and vLLM's ``/score``; each becomes a ``ScoringAsk`` (which texts are scored against which).

A cross-encoder reads each pair together (``ScoringAsk.pairs_request``: the engine's ``ScoreRequest``); an embedding
model embeds every text once (``texts_request``) and a pair's score is the cosine of its two vectors (``cosine``),
as vLLM scores with an embedding model. ``query`` (or one ``text_1``) is scored against every document; ``text_1``
and ``text_2`` lists of one length pair up one to one. What may be cut is ``pairs.Cut``'s: TEI's ``truncate`` (with
``truncation_direction``), or ``max_tokens_per_doc``.

TEI's ``raw_scores`` and vLLM's ``use_activation: false`` ask for the cross-encoder's logits without its activation;
an embedding model's cosine has none. The Cohere shape's ``return_documents`` defaults to true, as vLLM and Jina
answer (Cohere's own API defaults to false; its clients read the scores either way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from handler.engine.types import EmbeddingRequest, Embeddings, ScoreRequest
from handler.errors import BadRequest
from handler.prompt.pairs import NO_CUT, Cut
from handler.prompt.renderer import PromptRenderer

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
Count = Annotated[int, Field(strict=True, ge=1)]


@dataclass(frozen=True, slots=True)
class ScoringAsk:
    """What a rerank or score request scores: each of ``seconds`` against ``firsts[0]`` (one first) or against the
    first at its index; the request's field names, for errors."""

    firsts: tuple[str, ...]
    seconds: tuple[str, ...]
    first_param: str
    second_param: str
    cut: Cut = NO_CUT
    raw: bool = False

    def pairs_request(self, renderer: PromptRenderer, request_id: str, arrived_at: float) -> ScoreRequest:
        """The pairs for a cross-encoder, each read as its tokenizer pairs two texts."""
        pairs = tuple(renderer.pairs.pair(self._first(i), second, self.cut, self._where(i))
                      for i, second in enumerate(self.seconds))
        return ScoreRequest(request_id, pairs, arrived_at, self.second_param, self.raw)

    def texts_request(self, renderer: PromptRenderer, request_id: str, arrived_at: float,
                      max_model_len: int) -> EmbeddingRequest:
        """Every text alone, for an embedding model: the firsts, then the seconds; each within the context, or
        refused naming its field."""
        pairs = renderer.pairs
        firsts = [pairs.single(text, self.cut, param=self.first_param) for text in self.firsts]
        seconds = [pairs.single(text, self.cut, True, self._where(i)) for i, text in enumerate(self.seconds)]
        for ids, where in [*((ids, self.first_param) for ids in firsts),
                           *((ids, self._where(i)) for i, ids in enumerate(seconds))]:
            if not ids:
                raise BadRequest("the text is empty after tokenisation", param=where)
            if len(ids) > max_model_len:
                raise BadRequest(f"the text has {len(ids)} tokens; this model embeds at most {max_model_len} "
                                 "(option.max_model_len)", param=where)
        return EmbeddingRequest(request_id, tuple(firsts + seconds), arrived_at, self.second_param)

    def cosine(self, embeddings: Embeddings) -> list[float]:
        """Each pair's cosine similarity, from ``texts_request``'s vectors (as torch's ``cosine_similarity``)."""
        firsts, seconds = embeddings.vectors[:len(self.firsts)], embeddings.vectors[len(self.firsts):]
        return [_cosine(firsts[0 if len(firsts) == 1 else i], vector) for i, vector in enumerate(seconds)]

    def _first(self, index: int) -> str:
        return self.firsts[0 if len(self.firsts) == 1 else index]

    def _where(self, index: int) -> str:
        return self.second_param if len(self.seconds) == 1 else f"{self.second_param}[{index}]"


def _cosine(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / max(norms, 1e-8)


def _texts(values: list[str], param: str) -> tuple[str, ...]:
    if not values:
        raise BadRequest(f"{param} is empty: give at least one text", param=param)
    return tuple(values)


class TeiRerankRequest(BaseModel):
    """TEI's ``POST /rerank``."""

    model_config = _STRICT

    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = False
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"

    def ask(self, max_model_len: int) -> ScoringAsk:
        cut = Cut(fit=max_model_len, side=self.truncation_direction.lower()) if self.truncate else NO_CUT
        return ScoringAsk((self.query,), _texts(self.texts, "texts"), "query", "texts", cut, self.raw_scores)


class RerankDocument(BaseModel):
    """A document as an object (Cohere's v1 and Jina's form): its ``text``."""

    model_config = _STRICT

    text: str


class RerankRequest(BaseModel):
    """The Cohere / Jina shape vLLM serves: ``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``."""

    model_config = _STRICT

    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: Annotated[int, Field(strict=True, ge=0)] | None = None   # 0 or absent: every document (vLLM's rule)
    return_documents: bool = True
    max_tokens_per_doc: Count | None = None
    use_activation: bool | None = None      # vLLM's: false answers the logits

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def ask(self) -> ScoringAsk:
        return ScoringAsk((self.query,), _texts(self.texts(), "documents"), "query", "documents",
                          Cut(doc_tokens=self.max_tokens_per_doc), self.use_activation is False)


class ScoreRequestBody(BaseModel):
    """vLLM's ``POST /score`` (and ``/v1/score``): ``text_1`` against each ``text_2``, or lists pairing one to one."""

    model_config = _STRICT

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    max_tokens_per_doc: Count | None = None
    use_activation: bool | None = None

    def ask(self) -> ScoringAsk:
        firsts = _texts([self.text_1] if isinstance(self.text_1, str) else self.text_1, "text_1")
        seconds = _texts([self.text_2] if isinstance(self.text_2, str) else self.text_2, "text_2")
        if len(firsts) > 1 and len(firsts) != len(seconds):
            raise BadRequest(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1 (scored "
                             "against every text_2) or as many as text_2 (paired one to one)", param="text_1")
        return ScoringAsk(firsts, seconds, "text_1", "text_2", Cut(doc_tokens=self.max_tokens_per_doc),
                          self.use_activation is False)
