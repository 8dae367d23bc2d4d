"""The default CPU server (int8) through the real gunicorn server: the start log names the CPU and the int8 kernel
path, and a request's answer is the same bits whether it runs alone or beside other requests of every length."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.conftest import RunningServer, start_server, stop_server

PROMPTS = ["What is the capital of France?", "Name three colours.", "Count from one to five."]
CROWD = ["Write a long story about a lighthouse keeper and the sea. " * 6, "Hi", "List ten fruits.",
         "Explain photosynthesis in detail, step by step. " * 3]


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("int8"), {"OPTION_QUANTIZE": "auto"})
    yield running
    stop_server(running)


def chat(url: str, content: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "logprobs": True,
            "top_logprobs": 2}
    response = requests.post(f"{url}/invocations", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_start_log_names_the_cpu_and_the_int8_path(int8_server: RunningServer) -> None:
    log = int8_server.log()
    assert "cpu: " in log and "int8: 16-bit activations per block of 128" in log and " kernel" in log


def test_an_answer_does_not_depend_on_what_runs_beside_it(int8_server: RunningServer) -> None:
    alone = [chat(int8_server.url, prompt, 16) for prompt in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS) + len(CROWD)) as pool:
        crowd = [pool.submit(chat, int8_server.url, text, 48) for text in CROWD]
        together = [pool.submit(chat, int8_server.url, prompt, 16) for prompt in PROMPTS]
        results = [future.result() for future in together]
        for future in crowd:
            future.result()
    for single, batched in zip(alone, results, strict=True):
        assert batched["message"]["content"] == single["message"]["content"]
        for i, (a, b) in enumerate(zip(single["logprobs"]["content"], batched["logprobs"]["content"], strict=True)):
            assert a == b, (i, a, b)  # the same bits, not only the same argmax
