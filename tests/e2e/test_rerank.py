"""Rerank and score through the real server: tiny random BERT and XLM-RoBERTa cross-encoders served on TEI's
``/rerank``, the Cohere / Jina shape (``/rerank``, ``/v1/rerank``, ``/v2/rerank``), vLLM's ``/score`` and
``/v1/score`` and ``/invocations``, equal to plain transformers; LangChain's Cohere reranker, unchanged; an
embedding model scoring by cosine; a generating model refused; every refusal naming its field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from tests.e2e.conftest import post, start_server, stop_server
from tests.e2e.test_embeddings import bert_url  # noqa: F401 (an embedding model's server: scores by cosine)

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Cats sleep most of the day.", "Berlin is the capital of Germany.",
             "The weather today is sunny with a light wind.", "Deep learning models rank documents for a query."]


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def reranker(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A server of a tiny random cross-encoder (head size 64: the vLLM contract run serves it too)."""
    from tests.support.tiny_checkpoints import build_tiny_cross_encoder

    folder = build_tiny_cross_encoder(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}-reranker",
                                      request.param, hidden=256)
    running = start_server(folder.parent, {"OPTION_MODEL_ID": str(folder)})
    yield running.url, folder
    stop_server(running)


@pytest.fixture(scope="module")
def expected(reranker: tuple[str, Path]) -> torch.Tensor:
    from tests.support.tiny_checkpoints import reference_scores

    return reference_scores(reranker[1], [(QUERY, document) for document in DOCUMENTS])


def by_index(results: list[dict], key: str) -> torch.Tensor:
    """Scores in the documents' order, from an answer sorted best first."""
    scores = [result[key] for result in results]
    assert scores == sorted(scores, reverse=True)
    return torch.tensor([score for _, score in sorted((r["index"], r[key]) for r in results)])


def test_tei_rerank(reranker: tuple[str, Path], expected: torch.Tensor) -> None:
    from tests.support.tiny_checkpoints import reference_scores

    url = reranker[0]
    ranks = post(url, {"query": QUERY, "texts": DOCUMENTS}, "/rerank").json()
    torch.testing.assert_close(by_index(ranks, "score"), expected, rtol=1e-4, atol=1e-4)
    assert all(set(rank) == {"index", "score"} for rank in ranks)
    raw = post(url, {"query": QUERY, "texts": DOCUMENTS, "raw_scores": True, "return_text": True}, "/rerank").json()
    logits = reference_scores(reranker[1], [(QUERY, document) for document in DOCUMENTS], "identity")
    torch.testing.assert_close(by_index(raw, "score"), logits, rtol=1e-4, atol=1e-4)
    assert [rank["text"] for rank in raw] == [DOCUMENTS[rank["index"]] for rank in raw]
    invoked = post(url, {"query": QUERY, "texts": DOCUMENTS}).json()  # /invocations: query with texts
    torch.testing.assert_close(by_index(invoked, "score"), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank", "/invocations"])
def test_cohere_shaped_rerank(reranker: tuple[str, Path], expected: torch.Tensor, path: str) -> None:
    documents = [DOCUMENTS[0], *({"text": d} for d in DOCUMENTS[1:])]  # strings, or Cohere's v1 objects
    body = post(reranker[0], {"model": "m", "query": QUERY, "documents": documents}, path).json()
    assert body["model"] == "m" and body["id"] and body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    torch.testing.assert_close(by_index(body["results"], "relevance_score"), expected, rtol=1e-4, atol=1e-4)
    assert all(r["document"] == {"text": DOCUMENTS[r["index"]]} for r in body["results"])
    top = post(reranker[0], {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False},
               path).json()["results"]
    assert [r["index"] for r in top] == expected.argsort(descending=True)[:2].tolist()
    assert all("document" not in r for r in top)


def test_score_one_to_many_and_one_to_one(reranker: tuple[str, Path], expected: torch.Tensor) -> None:
    from tests.support.tiny_checkpoints import reference_scores

    url, folder = reranker
    body = post(url, {"model": "m", "text_1": QUERY, "text_2": DOCUMENTS}, "/score").json()
    assert body["object"] == "list" and body["model"] == "m" and body["usage"]["prompt_tokens"] > 0
    assert [item["index"] for item in body["data"]] == list(range(5)) and body["data"][0]["object"] == "score"
    torch.testing.assert_close(torch.tensor([item["score"] for item in body["data"]]), expected, rtol=1e-4, atol=1e-4)
    firsts = DOCUMENTS[1:] + DOCUMENTS[:1]
    paired = post(url, {"text_1": firsts, "text_2": DOCUMENTS, "use_activation": False}, "/v1/score").json()
    logits = reference_scores(folder, list(zip(firsts, DOCUMENTS, strict=True)), "identity")
    torch.testing.assert_close(torch.tensor([item["score"] for item in paired["data"]]), logits, rtol=1e-4, atol=1e-4)
    one = post(url, {"text_1": QUERY, "text_2": DOCUMENTS[2]}).json()  # /invocations: text_1 with text_2
    assert one["data"][0]["score"] == pytest.approx(expected[2].item(), abs=1e-4)


def test_langchain_cohere_reranker_unchanged(reranker: tuple[str, Path], expected: torch.Tensor) -> None:
    """LangChain's ``CohereRerank`` (cohere's ClientV2: ``POST /v2/rerank``) pointed at the server."""
    pytest.importorskip("langchain_cohere", reason="langchain-cohere is pinned in requirements-dev.txt")
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    reranker_client = CohereRerank(base_url=reranker[0], cohere_api_key="unused", model="tiny", top_n=3)
    kept = reranker_client.compress_documents([Document(page_content=d) for d in DOCUMENTS], QUERY)
    best = expected.argsort(descending=True)[:3].tolist()
    assert [doc.page_content for doc in kept] == [DOCUMENTS[i] for i in best]
    torch.testing.assert_close(torch.tensor([doc.metadata["relevance_score"] for doc in kept]), expected[best],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/rerank", {"query": QUERY, "texts": []}, "texts"),
    ("/rerank", {"query": QUERY, "texts": DOCUMENTS, "truncation_direction": "Up"}, "truncation_direction"),
    ("/rerank", {"query": QUERY, "texts": DOCUMENTS, "normalize": True}, "normalize"),
    ("/rerank", {"query": QUERY, "texts": [DOCUMENTS[0], " ".join(DOCUMENTS * 12)]}, "texts[1]"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"txt": "a"}]}, "documents[0].text"),
    ("/v1/rerank", {"documents": DOCUMENTS}, "query"),
    ("/score", {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS}, "text_1"),
    ("/score", {"text_1": QUERY, "text_2": [], "model": "m"}, "text_2"),
    ("/score", {"text_1": QUERY, "text_2": DOCUMENTS, "max_tokens_per_doc": 0}, "max_tokens_per_doc"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ("/v1/embeddings", {"input": "Hi"}, "input"),
])
def test_refusals_name_the_field(reranker: tuple[str, Path], path: str, body: dict, param: str) -> None:
    response = post(reranker[0], body, path)
    assert response.status_code in (400, 422), response.text
    error = response.json()["error"]
    assert (error["param"] if isinstance(error, dict) else response.json()["param"]) == param, response.text


def test_tei_truncate_cuts_what_would_not_fit(reranker: tuple[str, Path]) -> None:
    """TEI's ``truncate: true`` cuts a pair over the context (``truncation_direction`` picks the side) instead of
    refusing it; Cohere's ``max_tokens_per_doc`` cuts the document."""
    long_document = " ".join(DOCUMENTS * 12)
    for direction in ("Right", "left"):
        body = {"query": QUERY, "texts": [long_document], "truncate": True, "truncation_direction": direction}
        assert 0 <= post(reranker[0], body, "/rerank").json()[0]["score"] <= 1
    capped = post(reranker[0], {"query": QUERY, "documents": [long_document], "max_tokens_per_doc": 8}, "/rerank")
    assert capped.status_code == 200 and capped.json()["usage"]["prompt_tokens"] < 40, capped.text


def test_an_embedding_model_scores_by_cosine(bert_url: tuple[str, Path]) -> None:  # noqa: F811
    """As vLLM scores with an embedding model: each pair's score is the cosine of the two texts' embeddings."""
    from tests.support.tiny_checkpoints import reference_embeddings

    url, folder = bert_url
    vectors = reference_embeddings(folder, [QUERY, *DOCUMENTS], "mean", True)
    cosine = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:])
    scored = post(url, {"text_1": QUERY, "text_2": DOCUMENTS}, "/score").json()
    torch.testing.assert_close(torch.tensor([d["score"] for d in scored["data"]]), cosine, rtol=1e-4, atol=1e-4)
    reranked = post(url, {"query": QUERY, "documents": DOCUMENTS}, "/v1/rerank").json()["results"]
    torch.testing.assert_close(by_index(reranked, "relevance_score"), cosine, rtol=1e-4, atol=1e-4)
    tei = post(url, {"query": QUERY, "texts": DOCUMENTS}, "/rerank").json()
    torch.testing.assert_close(by_index(tei, "score"), cosine, rtol=1e-4, atol=1e-4)


def test_a_generating_model_is_refused(url: str) -> None:
    for path, body, param in [("/rerank", {"query": QUERY, "texts": DOCUMENTS}, "query"),
                              ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}, "query"),
                              ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}, "text_1")]:
        response = post(url, body, path)
        assert response.status_code == 400 and "generates text" in response.text, response.text
        error = response.json()["error"]
        assert (error["param"] if isinstance(error, dict) else response.json()["param"]) == param
    assert requests.get(f"{url}/ping", timeout=10).status_code == 200
