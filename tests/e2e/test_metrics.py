"""Metrics, request logs, backpressure and cancellation through the real server (gunicorn, multiprocess metrics).

The disconnect test proves a client that goes away frees its batch slot: the engine's own token counter shows the
abandoned request stopped far short of its 4,000 tokens, while a concurrent stream completed normally.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import RunningServer, start_server, stop_server

CHAT = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}]}
POLL_ATTEMPTS = 600  # x 0.1 s: a bound on waiting, not a speed requirement
# Long enough that the abandoned stream cannot end by itself before the second one holds its slot: with 500, once in
# make test-vllm (compiled vLLM, the session's server) the two never ran at once
ABANDONED_TOKENS = 4000


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    response = requests.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(predicate, what: str) -> None:
    pause = threading.Event()
    for _ in range(POLL_ATTEMPTS):
        if predicate():
            return
        pause.wait(0.1)
    raise AssertionError(f"gave up waiting for {what}")


def request_lines(server: RunningServer) -> list[dict]:
    return [json.loads(line) for line in server.log().splitlines() if line.startswith('{"time"')]


def request_line(server: RunningServer, request_id: str) -> dict:
    """The request's log line, written when its response closed (just after the client has it)."""
    found: list[dict] = []
    wait_until(lambda: found.extend(r for r in request_lines(server) if r["request_id"] == request_id) or found,
               f"the log line of {request_id}")
    return found[0]


def test_metrics_count_requests_and_tokens(server: RunningServer) -> None:
    url = server.url
    before = scrape(url)
    ok = requests.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 8}, timeout=120)
    bad = requests.post(f"{url}/invocations", json={"neither": 1}, timeout=30)
    missing = requests.get(f"{url}/no-such-route", timeout=30)
    assert ok.status_code == 200 and bad.status_code == 400 and missing.status_code == 404
    for response in (ok, bad, missing):  # every response carries an id, errors included
        assert response.headers["X-Request-Id"]
    answered = {"route": "/v1/chat/completions", "schema": "chat", "status": "200"}
    refused = {"route": "/invocations", "schema": "none", "status": "400"}
    unmatched = {"route": "unmatched", "schema": "none", "status": "404"}

    def counted() -> bool:  # a request is counted when its response closes, just after the client has it
        now = scrape(url)
        return all(value(now, "llm_requests_total", **labels) == value(before, "llm_requests_total", **labels) + 1
                   for labels in (answered, refused, unmatched))

    wait_until(counted, "the three requests to be counted")
    after = scrape(url)
    for name in ("llm_time_to_first_token_seconds_count", "llm_prompt_tokens_count", "llm_generated_tokens_count"):
        assert value(after, name) == value(before, name) + 1, name
    generated = ok.json()["usage"]["completion_tokens"]
    assert value(after, "llm_generated_tokens_sum") == value(before, "llm_generated_tokens_sum") + generated
    assert value(after, "llm_batch_size_count") > value(before, "llm_batch_size_count")
    wait_until(lambda: value(scrape(url), "llm_running_requests") == 0 == value(scrape(url), "llm_waiting_requests"),
               "the engine to go idle")
    line = request_line(server, ok.headers["X-Request-Id"])
    assert (line["schema"], line["status"], line["completion_tokens"]) == ("chat", 200, generated)
    assert line["ttft_s"] > 0 and "prompt" not in line and "lighthouse" not in json.dumps(line)


def stream_lines(response: requests.Response) -> Iterator[str]:
    return (line for line in response.iter_lines(decode_unicode=True) if line)


def first_content(lines: Iterator[str]) -> Iterator[str]:
    """The first non-empty content delta of an SSE chat stream, read from ``lines`` (an error frame fails here)."""
    for frame in lines:
        chunk = json.loads(frame.removeprefix("data: "))
        assert chunk.get("choices") is not None, chunk
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            yield chunk["choices"][0]["delta"]["content"]
            return


def test_disconnected_stream_frees_its_slot(server: RunningServer) -> None:
    url = server.url
    wait_until(lambda: value(scrape(url), "llm_running_requests") == 0, "the earlier tests' requests to end")
    tokens_before = value(scrape(url), "llm_engine_generated_tokens_total")
    finished: dict = {}

    def complete_normally() -> None:
        body = {"inputs": "Once upon a time", "stream": True, "parameters": {"max_new_tokens": 32,
                                                                            "ignore_eos": True, "details": True}}
        with requests.post(f"{url}/invocations", json=body, stream=True, timeout=120) as response:
            finished["last"] = json.loads(list(stream_lines(response))[-1])

    with requests.Session() as abandoned:
        response = abandoned.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": ABANDONED_TOKENS,
                                                                      "ignore_eos": True, "stream": True},
                                  stream=True, timeout=120)
        lines = stream_lines(response)
        for _ in range(4):
            next(lines)
        other = threading.Thread(target=complete_normally)
        other.start()
        wait_until(lambda: value(scrape(url), "llm_running_requests") == 2, "both streams to run")
        response.close()  # the client goes away mid-stream
    wait_until(lambda: value(scrape(url), "llm_running_requests") < 2, "the abandoned stream's slot to free")
    other.join(120)
    assert finished["last"]["details"] == {"finish_reason": "length", "generated_tokens": 32}
    wait_until(lambda: value(scrape(url), "llm_running_requests") == 0, "the engine to go idle")
    sampled = value(scrape(url), "llm_engine_generated_tokens_total") - tokens_before
    assert 32 < sampled < 32 + ABANDONED_TOKENS  # the abandoned request stopped early
    wait_until(lambda: any(r["finish_reason"] == "abort" for r in request_lines(server)), "the abort log line")


# ---- a server with tight limits --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    env = {"OPTION_MAX_ROLLING_BATCH_SIZE": "1", "OPTION_MAX_QUEUE_SIZE": "1", "OPTION_REQUEST_TIMEOUT": "3",
           "OPTION_LOG_PROMPTS": "true"}
    running = start_server(tmp_path_factory.mktemp("tight"), env)
    try:
        warm(running.url)
        yield running
    finally:
        stop_server(running)


def warm(url: str) -> None:
    """A fresh server's first requests can pay one-off costs: on vLLM (CPU) the first took longer than the 3 s
    deadline while the suite's other servers were up. The deadline tests are about requests that run, so short
    requests go first until one is answered in time (one cut by the deadline is a 504, and a timeout the tests count
    from where they start)."""
    for _ in range(10):
        response = requests.post(f"{url}/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                                 timeout=120)
        if response.status_code == 200:
            return
        assert response.status_code == 504, response.text
    pytest.fail("the server answered no 2-token request within its 3 s deadline in 10 tries")


def test_full_queue_is_429_and_deadlines_end_running_and_waiting_streams(tight: RunningServer) -> None:
    """The deadline ends the running stream like max_tokens (its tokens are the answer: "length") and the waiting
    one, which has none, with the timeout error. The waiting one arrives once the first has its first token (its
    deadline is that much later), so its prompt is long: when the slot frees, its chunked prefill outlasts that
    moment, and the deadline finds it without a token however slow the machine is."""
    url, long_chat = tight.url, {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    long_prompt = {"messages": [{"role": "user", "content": "Summarise: " + "the keeper counted the waves. " * 400}],
                   "max_tokens": 100, "stream": True}
    timeouts_before = value(scrape(url), "llm_request_timeouts_total")  # the warm-up's, if one was cut (``warm``)
    with requests.Session() as first, requests.Session() as second:
        running = first.post(f"{url}/v1/chat/completions", json=long_chat, stream=True, timeout=60)
        running_lines = stream_lines(running)
        # submitted and holding the only slot once its first token is out (the role delta comes before any token)
        text = next(first_content(running_lines))
        waiting = second.post(f"{url}/v1/chat/completions", json=long_prompt, stream=True, timeout=60)
        waiting_lines = stream_lines(waiting)
        next(waiting_lines)
        refused = requests.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=30)
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "rate_limit_error" and refused.headers["X-Request-Id"]
        frames = list(running_lines)
        assert frames[-1] == "data: [DONE]"
        chunks = [json.loads(frame.removeprefix("data: ")) for frame in frames[:-1]]
        assert chunks[-1].get("choices") and chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        assert text + "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        frames = list(waiting_lines)
        assert frames[-1] == "data: [DONE]"
        error = json.loads(frames[-2].removeprefix("data: "))["error"]
        assert error["type"] == "timeout_error" and "timed out after 3 s" in error["message"]
    wait_until(lambda: value(scrape(url), "llm_running_requests") == 0, "the engine to go idle")
    samples = scrape(url)
    assert value(samples, "llm_queue_rejections_total") == 1
    assert value(samples, "llm_request_timeouts_total") == timeouts_before + 2


def test_non_streaming_deadline_returns_the_text_so_far_and_prompts_are_logged_when_asked(
        tight: RunningServer) -> None:
    response = requests.post(f"{tight.url}/invocations", json={"inputs": "Count to a million:", "parameters":
                                                               {"max_new_tokens": 2000, "ignore_eos": True,
                                                                "details": True}},
                             timeout=60)
    assert response.status_code == 200 and response.headers["X-Request-Timeout"] == "3"
    body = response.json()
    assert body["details"]["finish_reason"] == "length" and 0 < body["details"]["generated_tokens"] < 2000
    assert body["generated_text"] == "".join(token["text"] for token in body["details"]["tokens"])
    line = request_line(tight, response.headers["X-Request-Id"])
    assert (line["status"], line["finish_reason"], line["prompt"]) == (200, "deadline", "Count to a million:")
