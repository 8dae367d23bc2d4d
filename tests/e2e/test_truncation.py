"""Prompts longer than the context: refused by default, truncated when the request asks (small-context server)."""

from __future__ import annotations

import pytest
import requests

from tests.e2e.conftest import post, start_server, stop_server

CONTEXT = 256


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("small-context"), {"OPTION_MAX_MODEL_LEN": str(CONTEXT)})
    yield server.url
    stop_server(server)


def test_too_long_prompt_is_refused_by_default(small):
    response = post(small, {"inputs": "word " * 400, "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 400 and str(CONTEXT) in response.json()["error"]


def test_error_behavior_truncate_keeps_the_prompt_tail(small):
    legacy = post(small, {"inputs": "word " * 400, "parameters": {"max_new_tokens": 2, "error_behavior": "truncate",
                                                                 "details": True}})
    assert legacy.status_code == 200 and legacy.json()["details"]["generated_tokens"] == 2
    chat = post(small, {"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 2,
                        "error_behavior": "truncate"})
    assert chat.status_code == 200
    assert chat.json()["usage"]["prompt_tokens"] == CONTEXT - 2


def test_legacy_truncate_keeps_the_last_tokens(small):
    def generate(repeats: int) -> requests.Response:
        return post(small, {"inputs": "word " * repeats + "The capital of France is",
                            "parameters": {"max_new_tokens": 6, "truncate": 16}})

    long, short = generate(400), generate(30)  # 400 words would not fit the context without truncation
    assert long.status_code == short.status_code == 200
    assert long.json()["generated_text"] == short.json()["generated_text"]  # both saw the same last 16 tokens
