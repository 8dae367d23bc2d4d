"""Rerank and score on the wire: the request models (TEI's, the Cohere / Jina shape, vLLM's score), which body
``/invocations`` takes for which, the answers' shapes, the cosine of an embedding model's pair, and which checkpoints
are cross-encoders with which activation."""

from __future__ import annotations

import pytest

from handler.endpoints.invocations import sniff_schema
from handler.engine.core.scoring import Activation, UnsupportedCrossEncoder, is_cross_encoder, read_activation
from handler.engine.types import Embeddings
from handler.errors import BadRequest
from handler.formatting.rerank import rerank_object, score_list, tei_ranks
from handler.prompt.pairs import Cut
from handler.protocol.common import parse_model
from handler.protocol.rerank import RerankRequest, ScoreRequestBody, ScoringAsk, TeiRerankRequest


@pytest.mark.parametrize(("body", "schema"), [
    ({"query": "q", "texts": ["a"]}, "tei_rerank"),
    ({"query": "q", "documents": ["a"], "top_n": 1}, "rerank"),
    ({"text_1": "q", "text_2": ["a"]}, "score"),
    ({"inputs": "x", "query": "q", "texts": ["a"]}, "legacy"),      # every earlier rule stands
    ({"input": "x", "query": "q", "documents": ["a"]}, "embeddings"),
    ({"messages": [], "text_1": "q", "text_2": "a"}, "chat"),
])
def test_invocations_takes_rerank_and_score_bodies_by_their_fields(body: dict, schema: str) -> None:
    assert sniff_schema(body) == schema


@pytest.mark.parametrize("body", [{"query": "q"}, {"text_1": "q"}, {"texts": ["a"]}])
def test_a_body_of_neither_shape_is_refused_naming_what_is_taken(body: dict) -> None:
    with pytest.raises(BadRequest, match="'query' with 'texts' or 'documents'"):
        sniff_schema(body)


def test_tei_request_defaults_and_cut() -> None:
    ask = parse_model(TeiRerankRequest, {"query": "q", "texts": ["a", "b"]}).ask(512)
    assert ask == ScoringAsk(("q",), ("a", "b"), "query", "texts")
    cut = parse_model(TeiRerankRequest, {"query": "q", "texts": ["a"], "truncate": True, "raw_scores": True,
                                         "truncation_direction": "Left"}).ask(512)
    assert cut.cut == Cut(fit=512, side="left") and cut.raw


def test_cohere_request_takes_strings_and_text_objects() -> None:
    parsed = parse_model(RerankRequest, {"query": "q", "documents": ["a", {"text": "b"}], "max_tokens_per_doc": 7,
                                         "use_activation": False, "top_n": None})
    ask = parsed.ask()
    assert ask.seconds == ("a", "b") and ask.cut == Cut(doc_tokens=7) and ask.raw
    assert parsed.return_documents and parsed.top_n is None


@pytest.mark.parametrize(("model", "body", "param"), [
    (TeiRerankRequest, {"query": "q", "texts": []}, "texts"),
    (TeiRerankRequest, {"query": "q", "texts": "a"}, "texts"),
    (TeiRerankRequest, {"query": "q", "texts": ["a"], "truncation_direction": "up"}, "truncation_direction"),
    (RerankRequest, {"query": "q", "documents": []}, "documents"),
    (RerankRequest, {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    (RerankRequest, {"query": "q", "documents": [{"text": "a", "title": "t"}]}, "documents[0].title"),
    (RerankRequest, {"query": 3, "documents": ["a"]}, "query"),
    (ScoreRequestBody, {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    (ScoreRequestBody, {"text_1": [], "text_2": ["a"]}, "text_1"),
    (ScoreRequestBody, {"text_1": "a"}, "text_2"),
])
def test_refusals_name_the_field(model, body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_model(model, body).ask(*([512] if model is TeiRerankRequest else []))
    assert info.value.param == param


def test_score_pairs_one_to_many_and_one_to_one() -> None:
    many = parse_model(ScoreRequestBody, {"text_1": "q", "text_2": ["a", "b"]}).ask()
    assert many.firsts == ("q",) and many.seconds == ("a", "b")
    one = parse_model(ScoreRequestBody, {"text_1": ["x", "y"], "text_2": ["a", "b"]}).ask()
    vectors = ((1.0, 0.0), (0.0, 1.0), (3.0, 4.0), (0.0, -2.0))  # x, y, a, b
    assert one.cosine(Embeddings(vectors, 4)) == pytest.approx([0.6, -1.0])
    assert many.cosine(Embeddings(((1.0, 0.0), (3.0, 4.0), (0.0, 0.0)), 3)) == pytest.approx([0.6, 0.0])


def test_answers_are_sorted_best_first_and_shaped_as_each_api() -> None:
    scores = [0.2, 0.9, 0.5, 0.9]
    assert tei_ranks(scores, None) == [{"index": 1, "score": 0.9}, {"index": 3, "score": 0.9},
                                       {"index": 2, "score": 0.5}, {"index": 0, "score": 0.2}]
    assert tei_ranks(scores[:2], ["a", "b"])[0] == {"index": 1, "score": 0.9, "text": "b"}
    body = rerank_object("rerank-1", "m", scores, ["a", "b", "c", "d"], 2, 12)
    assert body == {"id": "rerank-1", "model": "m", "usage": {"prompt_tokens": 12, "total_tokens": 12},
                    "results": [{"index": 1, "relevance_score": 0.9, "document": {"text": "b"}},
                                {"index": 3, "relevance_score": 0.9, "document": {"text": "d"}}]}
    assert len(rerank_object("r", "m", scores, None, 0, 1)["results"]) == 4  # top_n 0: all, as vLLM
    listed = score_list("score-1", "m", 7, scores, 12)
    assert listed["object"] == "list" and listed["created"] == 7
    assert listed["data"][3] == {"index": 3, "object": "score", "score": 0.9}
    assert listed["usage"] == {"prompt_tokens": 12, "total_tokens": 12, "completion_tokens": 0}


def _config(**fields) -> dict:
    return {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"},
            **fields}


@pytest.mark.parametrize(("config", "activation"), [
    (_config(), Activation("sigmoid", "default")),
    (_config(problem_type="regression"), Activation("sigmoid", "default")),  # sentence-transformers ignores it
    (_config(sbert_ce_default_activation_function="torch.nn.modules.linear.Identity"),
     Activation("identity", "sbert_ce_default_activation_function")),
    (_config(sentence_transformers={"activation_fn": "torch.nn.modules.activation.Tanh"},
             sbert_ce_default_activation_function="torch.nn.modules.linear.Identity"),
     Activation("tanh", "sentence_transformers.activation_fn")),
])
def test_the_activation_is_read_as_sentence_transformers_reads_it(config: dict, activation: Activation) -> None:
    assert is_cross_encoder(config) and read_activation(config) == activation


@pytest.mark.parametrize(("config", "message"), [
    (_config(id2label={"0": "NEG", "1": "POS"}), "2 labels"),
    (_config(sentence_transformers={"activation_fn": "torch.nn.modules.activation.Softmax"}), "Softmax"),
    (_config(model_type="qwen3", architectures=["Qwen3ForSequenceClassification"]), "decoder"),
])
def test_classifiers_that_are_no_cross_encoder(config: dict, message: str) -> None:
    with pytest.raises(UnsupportedCrossEncoder, match=message):
        read_activation(config)


def test_what_is_no_sequence_classifier() -> None:
    assert not is_cross_encoder({"model_type": "bert", "architectures": ["BertModel"]})
    assert not is_cross_encoder({"model_type": "llama"})


@pytest.mark.parametrize(("config", "context"), [
    ({"model_type": "xlm-roberta", "max_position_embeddings": 514, "pad_token_id": 1}, 512),  # bge-reranker's
    ({"model_type": "roberta", "max_position_embeddings": 130, "pad_token_id": 1}, 128),
    ({"model_type": "bert", "max_position_embeddings": 512, "pad_token_id": 0}, 512),
])
def test_roberta_kin_hold_their_positions_less_the_padding_offset(config: dict, context: int) -> None:
    from pathlib import Path

    from handler.config import Settings
    from handler.process.preflight import context_length

    assert context_length(Settings(model_id=str(Path(__file__).parent)), config) == context
