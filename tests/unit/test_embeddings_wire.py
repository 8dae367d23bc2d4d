"""Embeddings' plain parts (issue #27): pooling read from sentence-transformers' files, the pooling arithmetic, the
request's input forms, the response's encodings and the schema sniffing on /invocations."""

from __future__ import annotations

import base64
import json
import struct

import pytest
import torch

from handler.endpoints.invocations import sniff_schema
from handler.engine.core.pooling import UnsupportedPooling, pool, read_pooling
from handler.engine.types import Embeddings, Pooling
from handler.formatting.embeddings import embedding_list
from handler.protocol.common import parse_model
from handler.protocol.embeddings import EmbeddingRequestBody
from tests.support.tiny_checkpoints import add_sentence_transformers_config


def test_without_sentence_transformers_files_decoders_pool_the_last_token_and_encoders_the_first(tmp_path) -> None:
    assert read_pooling(tmp_path, is_encoder=False) == Pooling("last", True, "default")
    assert read_pooling(tmp_path, is_encoder=True) == Pooling("cls", True, "default")


@pytest.mark.parametrize(("mode", "normalize"), [("mean", True), ("cls", False), ("last", True)])
def test_sentence_transformers_files_say_how_to_pool(tmp_path, mode: str, normalize: bool) -> None:
    add_sentence_transformers_config(tmp_path, mode, normalize)
    assert read_pooling(tmp_path, is_encoder=True) == Pooling(mode, normalize, "sentence-transformers")


@pytest.mark.parametrize(("change", "words"), [
    (lambda modules, pooling: modules.append({"type": "sentence_transformers.models.Dense", "path": "2_Dense"}),
     "Dense"),
    (lambda modules, pooling: pooling.update(pooling_mode_max_tokens=True), "pooling_mode_max_tokens"),
    (lambda modules, pooling: pooling.update(pooling_mode_cls_token=True), "2 pooling modes"),
    (lambda modules, pooling: modules.pop(1), "no Pooling module"),
])
def test_pipelines_this_server_does_not_run_are_refused_naming_the_part(tmp_path, change, words: str) -> None:
    add_sentence_transformers_config(tmp_path, "mean", True)
    modules = json.loads((tmp_path / "modules.json").read_text())
    pooling = json.loads((tmp_path / "1_Pooling" / "config.json").read_text())
    change(modules, pooling)
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(UnsupportedPooling, match=words):
        read_pooling(tmp_path, is_encoder=False)


def test_pooling_reads_only_each_inputs_own_tokens() -> None:
    states = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [9.0, 9.0]], [[0.0, 2.0], [5.0, 5.0], [7.0, 1.0]]])
    lengths = [2, 3]
    torch.testing.assert_close(pool(states, lengths, Pooling("mean", False)), torch.tensor([[2.0, 2.0], [4.0, 8 / 3]]))
    assert pool(states, lengths, Pooling("last", False)).tolist() == [[3.0, 4.0], [7.0, 1.0]]
    assert pool(states, lengths, Pooling("cls", False)).tolist() == [[1.0, 0.0], [0.0, 2.0]]
    torch.testing.assert_close(pool(states, lengths, Pooling("last", True))[0], torch.tensor([0.6, 0.8]))


def test_the_four_input_forms_and_the_instruction() -> None:
    def body(**fields) -> EmbeddingRequestBody:
        return parse_model(EmbeddingRequestBody, fields)

    assert body(input="a").texts() == ["a"]
    assert body(input=["a", "b"], instruction="Query: ").texts() == ["Query: a", "Query: b"]
    assert body(input=[1, 2]).texts() is None and body(input=[1, 2]).token_inputs() == [[1, 2]]
    assert body(input=[[1], [2, 3]]).token_inputs() == [[1], [2, 3]]
    for bad in ({"input": "a", "encoding_format": "int8"}, {"input": [-1]}, {"input": "a", "dimensions": 0},
                {"input": "a", "extra": 1}, {}):
        with pytest.raises(Exception) as info:
            parse_model(EmbeddingRequestBody, bad)
        assert getattr(info.value, "status_code", None) == 400


def test_the_response_in_openais_shape_with_base64_as_little_endian_float32() -> None:
    result = Embeddings(((0.5, -1.25), (3.0, 0.0)), 7)
    floats = embedding_list(result, "m", "float")
    assert floats == {"object": "list", "model": "m", "usage": {"prompt_tokens": 7, "total_tokens": 7},
                      "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -1.25]},
                               {"object": "embedding", "index": 1, "embedding": [3.0, 0.0]}]}
    encoded = embedding_list(result, "m", "base64")["data"][0]["embedding"]
    assert struct.unpack("<2f", base64.b64decode(encoded)) == (0.5, -1.25)


def test_invocations_sniffs_input_as_embeddings_only_without_the_other_schemas_fields() -> None:
    assert sniff_schema({"input": "a"}) == "embeddings"
    assert sniff_schema({"input": "a", "prompt": "b"}) == "completions"
    assert sniff_schema({"input": "a", "messages": []}) == "chat"
