"""Rerank and score answers: TEI's list of ranks, the Cohere / Jina / vLLM rerank object, vLLM's score list.

A rerank answer is sorted by score, highest first (a tie keeps the documents' order); a score answer keeps the
pairs' order.
"""

from __future__ import annotations


def _ranked(scores: list[float]) -> list[int]:
    """Document indexes by score, highest first; stable."""
    return sorted(range(len(scores)), key=lambda index: -scores[index])


def tei_ranks(scores: list[float], texts: list[str] | None) -> list[dict]:
    """TEI's ``/rerank`` answer: ``[{"index", "score", "text"?}]`` (``text`` when ``return_text``)."""
    return [{"index": i, "score": scores[i], **({"text": texts[i]} if texts is not None else {})}
            for i in _ranked(scores)]


def rerank_object(request_id: str, model: str, scores: list[float], documents: list[str] | None,
                  top_n: int | None, num_tokens: int) -> dict:
    """The Cohere / Jina shape as vLLM answers it: ``results`` of ``{index, relevance_score, document?}``, the
    best ``top_n`` (all when it is absent or 0), and ``usage``."""
    ranked = _ranked(scores)[:top_n or None]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": documents[i]}} if documents is not None else {})} for i in ranked]
    return {"id": request_id, "model": model, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            "results": results}


def score_list(request_id: str, model: str, created: int, scores: list[float], num_tokens: int) -> dict:
    """vLLM's ``/score`` answer: a ``list`` of ``{index, object: "score", score}`` in the pairs' order."""
    return {"id": request_id, "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}
