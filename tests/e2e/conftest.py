"""The real server: ``python -m handler serve`` (gunicorn + Flask, embedded model) on a free loopback port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_for_ping(url: str, process: subprocess.Popen, log_path: Path, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/ping", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server did not become ready in {timeout} s:\n{log_path.read_text()[-3000:]}")


def start_server(tmp_path: Path, env: dict[str, str] | None = None, port: int | None = None) -> RunningServer:
    """The server on a free port (or ``port``), with the settings ``make serve`` and the image run (int8 on this
    CPU) unless ``env`` says otherwise; a test that needs other settings names them there and says why."""
    port = port or free_port()
    log_path = tmp_path / f"server-{port}.log"
    environ = {**os.environ, "SAGEMAKER_BIND_TO_PORT": str(port), "SERVER_HOST": "127.0.0.1",
               "SAGEMAKER_MODEL_DIR": str(tmp_path / "no-sagemaker-model"), **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "handler", "serve"], cwd=REPO_ROOT, env=environ,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = RunningServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_for_ping(server.url, process, log_path)
    except Exception:
        stop_server(server)
        raise
    return server


def start_tiny_vlm(tmp_path: Path, env: dict[str, str] | None = None, head_dim: int = 16) -> RunningServer:
    """The server on the tiny Idefics3 of ``tests.support.vision_fixture`` (built in ``tmp_path``), otherwise with the
    shipped settings. Two differ, and why: ``option.model_id`` (the embedded model is no vision model), and
    ``option.image_fetch_allowed_hosts=127.0.0.1``, because these tests' image server is on loopback, which the
    shipped SSRF rules refuse (tests/unit/test_image_fetch.py proves that refusal)."""
    from tests.support.vision_fixture import build_tiny_vlm  # torch: only the tests that serve a VLM pay for it

    model_dir = build_tiny_vlm(tmp_path / "tiny-idefics3", head_dim=head_dim)
    return start_server(tmp_path, env={"OPTION_MODEL_ID": str(model_dir),
                                       "OPTION_IMAGE_FETCH_ALLOWED_HOSTS": "127.0.0.1", **(env or {})})


def metric(url: str, line_start: str) -> float:
    """The value of the first /metrics line that starts with ``line_start`` (a name, with labels if any); 0 if none."""
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def stop_server(server: RunningServer, timeout: float = 40) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        return server.process.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("server"))
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def url(server: RunningServer) -> str:
    return server.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    """The openai SDK against the session's server (no retries)."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def post(url: str, body: object, path: str = "/invocations", **kwargs) -> requests.Response:
    """POST a JSON body to the server (``/invocations`` unless ``path`` says otherwise)."""
    return requests.post(f"{url}{path}", json=body, timeout=120, **kwargs)


def sse_events(response: requests.Response) -> list[dict]:
    """The JSON records of a whole SSE answer, which must end with ``data: [DONE]``."""
    frames = response.content.decode("utf-8").split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    return [json.loads(frame.removeprefix("data: ")) for frame in frames[:-2]]


def local_runtime(container_url: str) -> Iterator[str]:
    """The local SageMaker runtime (``devtools.local_runtime``) in front of a server, on a thread; yields its URL.
    16-byte PayloadParts, so stream records are cut across parts as the real service may cut them."""
    from devtools.local_runtime import RuntimeConfig, make_server

    runtime = make_server(RuntimeConfig(container_url=container_url, max_part_bytes=16), "127.0.0.1", 0)
    threading.Thread(target=runtime.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{runtime.server_address[1]}"
    finally:
        runtime.shutdown()
        runtime.server_close()


def runtime_client(runtime_url: str):
    """boto3's sagemaker-runtime client, unmodified, pointed at a local runtime (dummy credentials, no retries)."""
    import boto3
    from botocore.config import Config

    return boto3.client("sagemaker-runtime", endpoint_url=runtime_url, region_name="us-east-1",
                        aws_access_key_id="test", aws_secret_access_key="test",
                        config=Config(retries={"max_attempts": 1}))
