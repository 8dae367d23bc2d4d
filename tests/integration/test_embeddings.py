"""Embeddings through the engine (issue #27): a tiny random BERT sentence-transformers folder (the encoder path), a
tiny decoder with a sentence-transformers config on the lean path and the transformers path, pooled as the folder
says; values equal to plain transformers + torch, one input at a time, however the engine batches them."""

from __future__ import annotations

import pytest
import torch

from handler.engine.backend import EngineLimits
from handler.engine.core.tokenizer import load_tokenizer
from handler.engine.lean.engine import Engine, wait_until_ready
from handler.engine.lean.load import load
from handler.engine.lean.options import LoadOptions
from handler.engine.types import EmbeddingRequest, GenerationRequest
from handler.errors import BadRequest
from tests.support.tiny_checkpoints import (
    add_sentence_transformers_config,
    build_tiny,
    build_tiny_bert,
    reference_embeddings,
)

TEXTS = ["The capital of France is Paris.", "Hi", "A much longer input that spans more tokens than the step's budget "
         "of sixteen tokens, so the engine splits the inputs over several forwards."]


def engine_for(folder, rolling_batch: str = "auto") -> Engine:
    options = LoadOptions(folder, "float32", False, "cpu", max_running=4, max_model_len=128,
                          rolling_batch=rolling_batch)
    loaded = load(options, lambda: load_tokenizer(folder))[0]
    engine = Engine(lambda: loaded, EngineLimits(max_running=4, max_model_len=128, max_step_tokens=16))
    engine.start()
    wait_until_ready(engine, timeout=120)
    return engine


def embed(engine: Engine, folder, texts: list[str]) -> torch.Tensor:
    tokenizer = load_tokenizer(folder)
    inputs = tuple(tuple(tokenizer.encode(text, add_special_tokens=True)) for text in texts)
    return torch.tensor(engine.embed(EmbeddingRequest("e", inputs)).result().vectors)


@pytest.mark.parametrize(("mode", "normalize"), [("mean", True), ("cls", False)])
def test_an_encoder_embeds_as_its_sentence_transformers_config_says(tmp_path, mode: str, normalize: bool) -> None:
    folder = build_tiny_bert(tmp_path / "bert", mode, normalize)
    engine = engine_for(folder)
    try:
        got = embed(engine, folder, TEXTS)
        expected = reference_embeddings(folder, TEXTS, mode, normalize)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        assert torch.allclose(got.norm(dim=-1), torch.ones(3), atol=1e-5) == normalize
        with pytest.raises(BadRequest, match="embeddings only") as info:
            engine.submit(GenerationRequest("g", prompt_ids=(1, 2, 3), prompt_param="messages"))
        assert info.value.param == "messages"
    finally:
        engine.stop()


@pytest.mark.parametrize(("rolling_batch", "mode"), [("auto", "mean"), ("auto", "last"), ("transformers", "mean")])
def test_a_decoder_embeds_on_both_paths(tmp_path, rolling_batch: str, mode: str) -> None:
    folder = add_sentence_transformers_config(build_tiny(tmp_path / "llama", "llama"), mode, True)
    engine = engine_for(folder, rolling_batch)
    try:
        torch.testing.assert_close(embed(engine, folder, TEXTS), reference_embeddings(folder, TEXTS, mode, True),
                                   rtol=1e-4, atol=1e-5)
    finally:
        engine.stop()


def test_refusals_name_the_input(tmp_path) -> None:
    folder = build_tiny(tmp_path / "llama", "llama")  # no sentence-transformers config: last token, normalised
    engine = engine_for(folder)
    try:
        for inputs, param in [((), "input"), (((),), "input"), (((1,), tuple(range(200))), "input[1]"),
                              (((1, 10**6),), "input")]:
            with pytest.raises(BadRequest) as info:
                engine.embed(EmbeddingRequest("e", inputs))
            assert info.value.param == param
        torch.testing.assert_close(embed(engine, folder, TEXTS[:1]),
                                   reference_embeddings(folder, TEXTS[:1], "last", True), rtol=1e-4, atol=1e-5)
    finally:
        engine.stop()


def test_a_pipeline_with_other_modules_cannot_embed_and_says_why(tmp_path) -> None:
    import json

    folder = add_sentence_transformers_config(build_tiny(tmp_path / "llama", "llama"), "mean", True)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    engine = engine_for(folder)
    try:
        with pytest.raises(BadRequest, match="Dense"):
            engine.embed(EmbeddingRequest("e", ((1, 2),)))
    finally:
        engine.stop()
