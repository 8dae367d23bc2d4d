"""SageMaker's newer contracts through the real server (gunicorn, two workers where state is shared): stateful
sessions, the body limit as a setting, asynchronous endpoints' Content-Length, adapter registration by query string,
and boto3's SessionId through the local runtime.

Two workers (SAGEMAKER_MODEL_SERVER_WORKERS=2; the shipped default is one) because a session opened on one worker
must be usable, and once closed refused, on the other: each request opens a connection of its own, and the request
log's ``pid`` says which worker answered, so the tests go on until both have. The model is a tiny checkpoint
(``tests.support.tiny_checkpoints``): what is proven is the contract, not the text.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import RunningServer, local_runtime, runtime_client, start_server, stop_server
from tests.support.tiny_adapters import build_adapter
from tests.support.tiny_checkpoints import build_tiny

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION = "X-Amzn-SageMaker-New-Session-Id"
CLOSED = "X-Amzn-SageMaker-Closed-Session-Id"
IDENTIFIER = "X-Amzn-SageMaker-Adapter-Identifier"
PROMPT = list(range(300, 340))
COMPLETION = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
MAX_ROUNDS = 30  # pairs of concurrent requests before giving up on reaching both workers


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native")
    base = build_tiny(root / "base", "llama")
    return {"base": base, "a1": build_adapter(base, root / "a1", ["q_proj", "v_proj"], rank=4, alpha=8, seed=1)}


@pytest.fixture(scope="module")
def server(tmp_path_factory, folders) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("two-workers"), {
        "OPTION_MODEL_ID": str(folders["base"]), "OPTION_MAX_MODEL_LEN": "256", "OPTION_ENABLE_LORA": "true",
        "SAGEMAKER_MODEL_SERVER_WORKERS": "2", "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true",
        "SAGEMAKER_MAX_REQUEST_SIZE": str(16 * 1024 * 1024), "OPTION_ASYNC_INFERENCE": "true"})
    yield running
    stop_server(running)


def post(url: str, body: object, headers: dict | None = None, path: str = "/invocations") -> requests.Response:
    """One request on a connection of its own; a worker still loading (503) is asked again."""
    deadline = time.monotonic() + 120
    while True:
        response = requests.post(f"{url}{path}", json=body, headers={"Connection": "close", **(headers or {})},
                                 timeout=120)
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def request_lines(server: RunningServer) -> list[dict]:
    return [json.loads(line) for line in server.log().splitlines()
            if line.startswith("{") and '"event": "request"' in line]


def on_both_workers(server: RunningServer, send, check) -> None:
    """``send()`` in concurrent pairs until both workers have answered one (the log's pids), ``check`` on each."""
    seen_before = len(request_lines(server))
    pids: set[int] = set()
    for _ in range(MAX_ROUNDS):
        with ThreadPoolExecutor(2) as pool:
            for response in pool.map(lambda _: send(), range(2)):
                check(response)
        pids = {line["pid"] for line in request_lines(server)[seen_before:] if line["route"] == "/invocations"}
        if len(pids) == 2:
            return
    raise AssertionError(f"every request reached one worker ({pids}) in {MAX_ROUNDS} rounds")


def open_session(url: str) -> str:
    response = post(url, {"requestType": "NEW_SESSION"}, {SESSION: "NEW_SESSION"})
    assert response.status_code == 200, response.text
    header = response.headers[NEW_SESSION]
    assert re.fullmatch(r"[0-9a-f-]{36}; Expires=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", header), header
    return header.split(";")[0]


def test_a_session_opened_on_one_worker_serves_on_both_and_once_closed_is_refused_by_both(server) -> None:
    session_id = open_session(server.url)

    def served(response: requests.Response) -> None:
        assert response.status_code == 200, response.text

    on_both_workers(server, lambda: post(server.url, COMPLETION, {SESSION: session_id}), served)
    closed = post(server.url, {"requestType": "CLOSE"}, {SESSION: session_id})
    assert closed.status_code == 200 and closed.headers[CLOSED] == session_id

    def refused(response: requests.Response) -> None:
        assert response.status_code == 400, response.text
        assert "session not found" in response.json()["error"]["message"]

    on_both_workers(server, lambda: post(server.url, COMPLETION, {SESSION: session_id}), refused)
    again = post(server.url, {"requestType": "CLOSE"}, {SESSION: session_id})
    assert again.status_code == 400 and again.json()["param"] == SESSION


@pytest.mark.parametrize(("body", "headers", "field"), [
    ({"requestType": "CLOSE"}, {}, SESSION),
    ({"requestType": "CLOSE"}, {SESSION: "7b0c6a34-40a3-4dbb-9b2e-3f1c6f0d8e21"}, SESSION),
    ({"requestType": "INVALID_TYPE"}, {}, "requestType"),
    ({"requestType": "NEW_SESSION", "extra_field": "not_allowed"}, {}, "extra_field"),
])
def test_malformed_session_requests_are_400s(server, body: dict, headers: dict, field: str) -> None:
    response = post(server.url, body, headers)
    assert response.status_code == 400, response.text
    assert response.json()["param"] == field


def test_an_unknown_session_on_a_generation_request_is_a_400(server) -> None:
    response = post(server.url, COMPLETION, {SESSION: "invalid-session-id"}, path="/v1/completions")
    assert response.status_code == 400 and response.json()["error"]["param"] == SESSION


def test_a_10_mib_body_is_accepted_with_the_size_setting(server) -> None:
    body = {**COMPLETION, "user": "x" * (10 * 1024 * 1024)}
    response = post(server.url, body, path="/v1/completions")
    assert response.status_code == 200, response.text[:300]
    over = post(server.url, {**COMPLETION, "user": "x" * (17 * 1024 * 1024)}, path="/v1/completions")
    assert over.status_code == 413 and str(16 * 1024 * 1024) in over.json()["error"]["message"]


def test_an_async_mode_stream_is_answered_with_a_content_length(server) -> None:
    response = post(server.url, {**COMPLETION, "max_tokens": 8, "stream": True})
    assert response.status_code == 200
    assert "chunked" not in response.headers.get("Transfer-Encoding", "")
    assert int(response.headers["Content-Length"]) == len(response.content)
    records = [json.loads(line) for line in response.text.splitlines()]
    assert records and records[-1]["choices"][0]["finish_reason"] == "length"


def test_an_adapter_registered_by_query_string_serves(server, folders) -> None:
    response = requests.post(f"{server.url}/adapters", params={"name": "by-query", "src": str(folders["a1"])},
                             timeout=60)
    assert response.status_code == 200, response.text
    adapted = post(server.url, COMPLETION, {IDENTIFIER: "by-query"}, path="/v1/completions")
    base = post(server.url, COMPLETION, path="/v1/completions")
    assert adapted.status_code == 200, adapted.text
    assert adapted.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]


def test_boto3_opens_uses_and_closes_a_session_through_the_local_runtime(server) -> None:
    runtime = local_runtime(server.url)
    client = runtime_client(next(runtime))
    try:
        opened = client.invoke_endpoint(EndpointName="local", ContentType="application/json", SessionId="NEW_SESSION",
                                        Body=json.dumps({"requestType": "NEW_SESSION"}))
        session_id = opened["NewSessionId"].split(";")[0]
        answer = client.invoke_endpoint(EndpointName="local", ContentType="application/json", SessionId=session_id,
                                        Body=json.dumps(COMPLETION))
        assert len(json.loads(answer["Body"].read())["choices"]) == 1
        closed = client.invoke_endpoint(EndpointName="local", ContentType="application/json", SessionId=session_id,
                                        Body=json.dumps({"requestType": "CLOSE"}))
        assert closed["ClosedSessionId"] == session_id
        with pytest.raises(client.exceptions.ModelError) as info:
            client.invoke_endpoint(EndpointName="local", ContentType="application/json", SessionId=session_id,
                                   Body=json.dumps(COMPLETION))
        assert info.value.response["OriginalStatusCode"] == 400
    finally:
        runtime.close()


# ---- a session keeps its conversation's prefix under competing traffic (one worker: the shipped default) ----------
BUDGET = "1MiB"  # the tiny model's KV: 512 bytes a position, so 2,048 positions: the competitors overflow it


@pytest.fixture(scope="module")
def warm_server(tmp_path_factory, folders) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("one-worker"), {
        "OPTION_MODEL_ID": str(folders["base"]), "OPTION_MAX_MODEL_LEN": "512", "OPTION_KV_CACHE_MEMORY": BUDGET,
        "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true"})
    yield running
    stop_server(running)


def counter(url: str, name: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def prefix_hits(url: str, prompt: list[int], headers: dict | None = None) -> int:
    """Complete ``prompt``; the prefix-cache hits (tokens) its admission got, once the engine has reported them."""
    queries = counter(url, "llm_prefix_cache_queries_tokens_total")
    hits = counter(url, "llm_prefix_cache_hits_tokens_total")
    response = post(url, {**COMPLETION, "prompt": prompt}, headers, path="/v1/completions")
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 30
    while counter(url, "llm_prefix_cache_queries_tokens_total") < queries + len(prompt) - 1:
        assert time.monotonic() < deadline, "the engine never reported the request's prefix lookup"
        time.sleep(0.05)
    return int(counter(url, "llm_prefix_cache_hits_tokens_total") - hits)


def compete(url: str, round_: int) -> None:
    """Four 400-token prompts no conversation shares: 1,600 positions of blocks, more than the budget has besides
    the slabs and a session's pins, so every block nobody pins is evicted."""
    for index in range(4):
        start = 4000 + 2000 * round_ + 400 * index
        assert post(url, {**COMPLETION, "prompt": list(range(start, start + 400))}, path="/v1/completions").ok


def test_a_sessions_later_turn_keeps_its_prefix_under_competing_traffic(warm_server) -> None:
    url = warm_server.url
    session_id = open_session(url)
    in_session = {SESSION: session_id}
    turns = [list(range(1000, 1096 + 48 * k)) for k in range(4)]       # each turn extends the one before
    control = [list(range(2000, 2096 + 48 * k)) for k in range(4)]     # the same conversation, no session
    assert prefix_hits(url, turns[0], in_session) == 0
    assert prefix_hits(url, control[0]) == 0
    for k in range(1, 4):
        compete(url, k)
        assert prefix_hits(url, turns[k], in_session) == len(turns[k - 1])  # every block of the turn before
        compete(url, k + 10)
        assert prefix_hits(url, control[k]) == 0                             # evicted by the competitors
    assert post(url, {"requestType": "CLOSE"}, in_session).status_code == 200
    compete(url, 20)
    assert prefix_hits(url, turns[3] + list(range(3000, 3048))) == 0  # closed: its blocks were let go


# ---- priority: a better priority submitted behind a full queue is admitted first (one batch slot) ----------------
@pytest.fixture(scope="module")
def one_slot(tmp_path_factory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("one-slot")
    model = build_tiny(tmp / "long", "llama", max_position_embeddings=4096)  # room for a slot holder's long answer
    running = start_server(tmp, {"OPTION_MODEL_ID": str(model), "OPTION_MAX_MODEL_LEN": "4096",
                                 "OPTION_MAX_ROLLING_BATCH_SIZE": "1"})
    yield running
    stop_server(running)


def wait_for(url: str, name: str, value: float) -> None:
    deadline = time.monotonic() + 30
    while counter(url, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def test_a_better_priority_behind_a_full_queue_finishes_first(one_slot) -> None:
    url, finished = one_slot.url, []
    # the one batch slot: a stream that runs until this test closes it
    holder = requests.post(f"{url}/v1/completions", json={**COMPLETION, "max_tokens": 4000, "stream": True},
                           stream=True, timeout=120)
    wait_for(url, "llm_running_requests", 1)

    def complete(name: str, headers: dict | None = None, body: dict | None = None) -> None:
        response = post(url, {**COMPLETION, **(body or {})}, headers, path="/v1/completions")
        assert response.status_code == 200, response.text
        finished.append(name)

    with ThreadPoolExecutor(6) as pool:
        late = [pool.submit(complete, f"low{i}", {"X-Amzn-SageMaker-Custom-Attributes": "x-priority=5"})
                for i in range(4)]
        wait_for(url, "llm_waiting_requests", 4)   # the queue behind the slot holds the four
        urgent = pool.submit(complete, "urgent", None, {"priority": -1})
        wait_for(url, "llm_waiting_requests", 5)
        holder.close()                              # the slot frees: who is admitted next?
        for future in [*late, urgent]:
            future.result()
    assert finished[0] == "urgent", finished
