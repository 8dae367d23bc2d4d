"""Adapters from S3, and adapters registered on one gunicorn worker served by every worker, through the real server.

The server runs two workers (SAGEMAKER_MODEL_SERVER_WORKERS=2; the shipped default is one) because what is proven
here is that ``POST /adapters`` and ``DELETE /adapters/{name}``, which reach one worker, hold for requests that
reach the other. Each request opens its own connection, and the request log's ``pid`` says which worker answered:
the tests go on until both have, so they cannot pass on one worker alone. S3 is moto's server on loopback
(``tests/support/s3_stand_in.py``); an adapter downloaded from it must give the tokens the same adapter gives from a
local folder.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import RunningServer, start_server, stop_server
from tests.support.s3_stand_in import S3StandIn
from tests.support.tiny_adapters import build_adapter
from tests.support.tiny_checkpoints import build_tiny

IDENTIFIER = "X-Amzn-SageMaker-Adapter-Identifier"
PROMPT = list(range(300, 340))
MAX_ROUNDS = 30  # pairs of concurrent requests before giving up on reaching both workers


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny(root / "base", "llama")
    return {"base": base,
            "a1": build_adapter(base, root / "a1", ["q_proj", "v_proj"], rank=4, alpha=8, seed=1),
            "a2": build_adapter(base, root / "a2", ["o_proj", "gate_proj", "down_proj"], rank=8, alpha=16, seed=2)}


@pytest.fixture(scope="module")
def s3(folders: dict[str, Path]) -> Iterator[S3StandIn]:
    with S3StandIn() as stand_in:
        stand_in.upload("adapters", "team/a1", folders["a1"])
        yield stand_in


@pytest.fixture(scope="module")
def server(tmp_path_factory, folders, s3) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("two-workers")
    running = start_server(tmp, {
        **s3.env, "OPTION_MODEL_ID": str(folders["base"]), "OPTION_ENABLE_LORA": "true",
        "OPTION_MAX_MODEL_LEN": "256", "OPTION_DOWNLOAD_DIR": str(tmp / "cache"),
        "SAGEMAKER_MODEL_SERVER_WORKERS": "2"})
    yield running
    stop_server(running)


def post(url: str, path: str, body: dict, headers: dict | None = None) -> requests.Response:
    """One request on a connection of its own; a worker still loading (503) is asked again."""
    deadline = time.monotonic() + 120
    while True:
        response = requests.post(f"{url}{path}", json=body, headers={"Connection": "close", **(headers or {})},
                                 timeout=120)
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def complete(url: str, adapter: str | None) -> requests.Response:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return post(url, "/v1/completions", body, {IDENTIFIER: adapter} if adapter else None)


def register(url: str, name: str, src: str) -> requests.Response:
    return post(url, "/adapters", {"name": name, "src": src})


def request_lines(server: RunningServer) -> list[dict]:
    return [json.loads(line) for line in server.log().splitlines()
            if line.startswith("{") and '"event": "request"' in line]


def on_both_workers(server: RunningServer, adapter: str | None, check) -> None:
    """Send ``adapter``'s completion in concurrent pairs until both workers have answered one (by the log's pid),
    applying ``check`` to every response."""
    seen_before = len(request_lines(server))
    for _ in range(MAX_ROUNDS):
        with ThreadPoolExecutor(2) as pool:
            for response in pool.map(lambda _: complete(server.url, adapter), range(2)):
                check(response)
        pids = {line["pid"] for line in request_lines(server)[seen_before:] if line["route"] == "/v1/completions"}
        if len(pids) == 2:
            return
    raise AssertionError(f"every request reached one worker ({pids}) in {MAX_ROUNDS} rounds")


def test_an_s3_adapter_gives_the_local_folders_tokens(server, folders) -> None:
    url = server.url
    assert register(url, "local-a1", str(folders["a1"])).status_code == 200
    answer = register(url, "s3-a1", "s3://adapters/team/a1")
    assert answer.status_code == 200, answer.text
    assert answer.json()["adapter"]["src"] == "s3://adapters/team/a1"
    local = complete(url, "local-a1").json()["choices"][0]
    from_s3 = complete(url, "s3-a1").json()["choices"][0]
    base = complete(url, None).json()["choices"][0]
    assert from_s3["text"] == local["text"] != base["text"]
    assert "download: downloaded s3://adapters/team/a1/" in server.log()


@pytest.mark.parametrize(("src", "message"), [
    ("s3://nobucket/a1", "src s3://nobucket/a1: S3 answered NoSuchBucket"),
    ("s3://adapters/absent", "src s3://adapters/absent: no objects under this prefix"),
    ("s3:///a1", "src s3:///a1: no bucket in the s3:// URL"),
])
def test_an_s3_src_that_is_not_there_is_a_400_naming_src(server, src: str, message: str) -> None:
    response = register(server.url, "missing", src)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "src" and error["message"].startswith(message), error
    assert "\n" not in error["message"] and "Traceback" not in response.text


def test_a_registration_on_one_worker_is_served_by_both_and_a_delete_removes_it_from_both(server, folders) -> None:
    url = server.url
    assert register(url, "shared", str(folders["a1"])).status_code == 200
    expected = complete(url, "shared").json()["choices"][0]["text"]
    assert expected != complete(url, None).json()["choices"][0]["text"]

    def same_tokens(response: requests.Response) -> None:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected

    on_both_workers(server, "shared", same_tokens)

    assert requests.delete(f"{url}/adapters/shared", headers={"Connection": "close"}, timeout=30).status_code == 200

    def not_found(response: requests.Response) -> None:
        assert response.status_code == 404, response.text
        assert "shared" in response.json()["error"]["message"]

    on_both_workers(server, "shared", not_found)

    # the same name registered again from another folder: both workers serve the new adapter, not the one they held
    assert register(url, "shared", str(folders["a2"])).status_code == 200
    expected = complete(url, "shared").json()["choices"][0]["text"]
    assert expected != complete(url, None).json()["choices"][0]["text"]
    on_both_workers(server, "shared", same_tokens)
    listed = requests.get(f"{url}/adapters", headers={"Connection": "close"}, timeout=30).json()["adapters"]
    assert "shared" in {a["name"] for a in listed}
