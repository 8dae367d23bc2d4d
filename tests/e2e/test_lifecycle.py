"""SIGTERM through the real gunicorn process: /ping turns 503, new work is refused, in-flight work finishes, exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import requests

from tests.e2e.conftest import start_server, stop_server


def test_sigterm_drains_in_flight_requests_and_exits_zero(tmp_path):
    server = start_server(tmp_path)
    lines: list[dict] = []

    def stream() -> None:
        body = {"inputs": "Count to a hundred:", "parameters": {"max_new_tokens": 60, "ignore_eos": True},
                "stream": True}
        with requests.post(f"{server.url}/invocations", json=body, stream=True, timeout=120) as response:
            for line in response.iter_lines():
                lines.append(json.loads(line))

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not lines and time.monotonic() < deadline:  # the stream is running before the signal
            time.sleep(0.05)
        assert lines, "the stream never started"
        server.process.send_signal(signal.SIGTERM)
        statuses = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and 503 not in statuses:
            statuses.append(requests.get(f"{server.url}/ping", timeout=5).status_code)
            time.sleep(0.05)
        assert 503 in statuses
        refused = requests.post(f"{server.url}/invocations", json={"inputs": "x"}, timeout=10)
        assert refused.status_code == 503 and "stopping" in refused.json()["error"]
        reader.join(timeout=120)
        assert lines[-1]["generated_text"] is not None and len(lines) == 60
        assert server.process.wait(timeout=40) == 0
    finally:
        stop_server(server)
        reader.join(timeout=5)
