"""The KV budget through the real server: the metrics that report it, a prefix-cache hit on a repeated system
prompt, and a budget that cannot hold one sequence stopping the start in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from handler.config import DEFAULT_MODEL_DIR
from tests.e2e.conftest import metric, post, start_server, stop_server
from tests.e2e.test_model_reach import serve_and_fail

SYSTEM = "You are a patient tutor. " + "Answer in full sentences and explain each step of your reasoning. " * 20


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory):
    """The shipped server with a KV budget small enough to reach (512 MiB) and a 2,048-token context, so that the
    budget's gauge and its start-up sizing are exercised at a scale these tests can fill; both are settings users
    set, and the tests are about honouring them."""
    server = start_server(tmp_path_factory.mktemp("kv"), env={"OPTION_KV_CACHE_MEMORY": "512MiB",
                                                               "OPTION_MAX_MODEL_LEN": "2048"})
    yield server
    stop_server(server)


def chat(url: str, question: str) -> dict:
    response = post(url, {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                          "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_budget_and_prefix_hits_are_in_the_metrics(budgeted) -> None:
    url = budgeted.url
    chat(url, "What is two plus two?")
    assert metric(url, "llm_kv_cache_budget_bytes") == 512 * 2**20
    hits = metric(url, "llm_prefix_cache_hits_tokens_total")
    queries = metric(url, "llm_prefix_cache_queries_tokens_total")
    chat(url, "What is three plus three?")
    assert metric(url, "llm_prefix_cache_queries_tokens_total") > queries
    assert metric(url, "llm_prefix_cache_hits_tokens_total") - hits >= 256  # the system prompt's whole blocks
    assert 0 < metric(url, "llm_kv_cache_allocated_bytes") <= 512 * 2**20


def test_a_budget_that_cannot_hold_one_sequence_stops_the_start_in_one_line(tmp_path: Path) -> None:
    code, lines = serve_and_fail(DEFAULT_MODEL_DIR, tmp_path, OPTION_KV_CACHE_MEMORY="64MiB",
                                 OPTION_MAX_MODEL_LEN="8192")
    assert code != 0
    [line] = [line for line in lines if line.startswith("error: ")]
    assert "option.kv_cache_memory" in line and "option.max_model_len=8192" in line


def test_a_malformed_budget_is_refused_naming_the_key(tmp_path: Path) -> None:
    code, lines = serve_and_fail(DEFAULT_MODEL_DIR, tmp_path, OPTION_KV_CACHE_MEMORY="lots")
    assert code != 0
    [line] = [line for line in lines if line.startswith("error: ")]
    assert "kv_cache_memory" in line
