"""Cross-encoders through the lean engine: tiny random BERT and XLM-RoBERTa sequence classifiers (with tokenizers of
their own kind) score pairs as plain transformers does, one pair at a time, to 1e-4, however the engine batches them;
the activation is the one the checkpoint names; classifiers that are no cross-encoder are refused at load, and a
cross-encoder neither generates nor embeds."""

from __future__ import annotations

import threading

import pytest
import torch

from handler.engine.backend import EngineLimits
from handler.engine.core.tokenizer import load_tokenizer
from handler.engine.lean.engine import Engine, wait_until_ready
from handler.engine.lean.load import load
from handler.engine.lean.options import LoadOptions
from handler.engine.model.support import UnsupportedModel
from handler.engine.types import EmbeddingRequest, GenerationRequest
from handler.errors import BadRequest
from handler.prompt.pairs import Cut
from handler.prompt.renderer import PromptRenderer
from handler.protocol.rerank import ScoringAsk
from tests.support.tiny_checkpoints import build_tiny, build_tiny_cross_encoder, reference_scores

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Cats sleep most of the day.", "Berlin is the capital of Germany.",
             "The weather today is sunny with a light wind, and deep learning models rank documents for a query.",
             "France"]


def engine_for(folder, step_tokens: int) -> Engine:
    options = LoadOptions(folder, "float32", False, "cpu", max_running=4, max_model_len=128, rolling_batch="auto")
    loaded = load(options, lambda: load_tokenizer(folder))[0]
    engine = Engine(lambda: loaded, EngineLimits(max_running=4, max_model_len=128, max_step_tokens=step_tokens))
    engine.start()
    wait_until_ready(engine, timeout=120)
    return engine


def scores(engine: Engine, renderer: PromptRenderer, ask: ScoringAsk) -> torch.Tensor:
    return torch.tensor(engine.score(ask.pairs_request(renderer, "r", 0.0)).result().values)


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def folder(request, tmp_path_factory):
    return build_tiny_cross_encoder(tmp_path_factory.mktemp(request.param) / "ce", request.param)


@pytest.mark.parametrize("step_tokens", [16, 4096])  # one pair a forward, or every queued pair in one
def test_scores_equal_transformers_however_batched(folder, step_tokens: int) -> None:
    renderer = PromptRenderer(load_tokenizer(folder))
    expected = reference_scores(folder, [(QUERY, d) for d in DOCUMENTS])
    assert expected.max() - expected.min() > 0.05  # the pairs score apart: a wrong pairing would show
    engine = engine_for(folder, step_tokens)
    try:
        ask = ScoringAsk((QUERY,), tuple(DOCUMENTS), "query", "documents")
        torch.testing.assert_close(scores(engine, renderer, ask), expected, rtol=1e-4, atol=1e-4)
        # several requests queued at once share forwards: each still gets its own pairs' scores
        got: dict[int, torch.Tensor] = {}
        jobs = [ScoringAsk((QUERY,), tuple(DOCUMENTS[i:] + DOCUMENTS[:i]), "query", "documents") for i in range(4)]
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, scores(engine, renderer, jobs[i])))
                   for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for i in range(4):
            torch.testing.assert_close(got[i], torch.cat([expected[i:], expected[:i]]), rtol=1e-4, atol=1e-4)
        raw = scores(engine, renderer, ScoringAsk((QUERY,), tuple(DOCUMENTS), "query", "documents", raw=True))
        logits = reference_scores(folder, [(QUERY, d) for d in DOCUMENTS], "identity")
        torch.testing.assert_close(raw, logits, rtol=1e-4, atol=1e-4)
    finally:
        engine.stop()


def test_one_to_one_pairs_and_a_cut_pair(folder) -> None:
    """text_1 and text_2 lists pair up by index; TEI's truncate cuts a pair as the tokenizer's longest-first rule."""
    from transformers import AutoTokenizer

    renderer = PromptRenderer(load_tokenizer(folder))
    firsts = tuple(DOCUMENTS[1:] + DOCUMENTS[:1])
    engine = engine_for(folder, 64)
    try:
        ask = ScoringAsk(firsts, tuple(DOCUMENTS), "text_1", "text_2")
        expected = reference_scores(folder, list(zip(firsts, DOCUMENTS, strict=True)))
        torch.testing.assert_close(scores(engine, renderer, ask), expected, rtol=1e-4, atol=1e-4)
        long_doc = " ".join(DOCUMENTS * 6)
        pair = renderer.pairs.pair(QUERY, long_doc, Cut(fit=24, side="left"))
        tokenizer = AutoTokenizer.from_pretrained(folder, truncation_side="left")
        expected = tokenizer(QUERY, long_doc, truncation=True, max_length=24)
        assert list(pair.ids) == expected["input_ids"]
        types = expected.get("token_type_ids")  # BERT's; XLM-RoBERTa's tokenizer gives none
        assert pair.second_start == (types.index(1) if types else len(pair.ids))
        with pytest.raises(BadRequest) as info:  # uncut, the long pair is over the context: refused, named
            engine.score(ScoringAsk((QUERY,), (DOCUMENTS[0], long_doc * 3), "query", "texts")
                         .pairs_request(renderer, "r", 0.0))
        assert info.value.param == "texts[1]"
    finally:
        engine.stop()


@pytest.mark.parametrize(("activation", "name"), [("torch.nn.modules.linear.Identity", "identity"),
                                                  ("torch.nn.modules.activation.Tanh", "tanh")])
def test_the_activation_the_checkpoint_names(tmp_path, activation: str, name: str) -> None:
    folder = build_tiny_cross_encoder(tmp_path / "ce", "bert", activation=activation)
    renderer = PromptRenderer(load_tokenizer(folder))
    engine = engine_for(folder, 4096)
    try:
        got = scores(engine, renderer, ScoringAsk((QUERY,), tuple(DOCUMENTS), "query", "documents"))
        torch.testing.assert_close(got, reference_scores(folder, [(QUERY, d) for d in DOCUMENTS], name),
                                   rtol=1e-4, atol=1e-4)
    finally:
        engine.stop()


def test_a_cross_encoder_neither_generates_nor_embeds(folder) -> None:
    engine = engine_for(folder, 64)
    try:
        assert engine.score_type == "cross-encoder" and not engine.embeds_only
        with pytest.raises(BadRequest, match="does not generate") as info:
            engine.submit(GenerationRequest("g", prompt_ids=(1, 2, 3), prompt_param="messages"))
        assert info.value.param == "messages"
        with pytest.raises(BadRequest, match="cross-encoder") as info:
            engine.embed(EmbeddingRequest("e", ((1, 2, 3),)))
        assert info.value.param == "input"
    finally:
        engine.stop()


def test_classifiers_that_are_no_cross_encoder_are_refused_at_load(tmp_path) -> None:
    options = lambda folder: LoadOptions(folder, "float32", False, "cpu", 4, 128, rolling_batch="auto")  # noqa: E731
    two = build_tiny_cross_encoder(tmp_path / "two", "bert", num_labels=2)
    with pytest.raises(UnsupportedModel, match="2 labels"):
        load(options(two), lambda: load_tokenizer(two))
    softmax = build_tiny_cross_encoder(tmp_path / "softmax", "bert", activation="torch.nn.modules.activation.Softmax")
    with pytest.raises(UnsupportedModel, match="Softmax"):
        load(options(softmax), lambda: load_tokenizer(softmax))
    decoder = build_tiny(tmp_path / "llama", "llama")
    import json

    config = json.loads((decoder / "config.json").read_text())
    (decoder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"],
                                                     "num_labels": 1}))
    with pytest.raises(UnsupportedModel, match="decoder with a classification head"):
        load(options(decoder), lambda: load_tokenizer(decoder))
