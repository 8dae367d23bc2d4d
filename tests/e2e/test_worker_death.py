"""A worker killed (SIGKILL) while streams are open, through the real gunicorn server: each stream's client sees its
connection closed (an error reading it, never its final record, never a read that hangs), the master starts a new
worker, /ping answers again, and the metrics count each request that was answered exactly once (the dead worker's
counts stay, its streams are counted nowhere, its live gauges stop counting).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from dataclasses import dataclass, field

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import RunningServer, start_server, stop_server, wait_for_ping

LONG = {"max_new_tokens": 4000, "ignore_eos": True}
# A stream's reads wait at most this long for bytes: a hang would end as a ReadTimeout, not a closed connection.
READ_TIMEOUT_S = 60


@dataclass
class StreamClient:
    """One stream read on a thread: its records, and how the reading ended."""

    path: str
    body: dict
    headers: dict = field(default_factory=dict)
    records: list[bytes] = field(default_factory=list)
    ended: str = ""  # "complete", "closed" (the connection went) or "timeout" (a read waited READ_TIMEOUT_S)
    started: threading.Event = field(default_factory=threading.Event)

    def read(self, url: str) -> None:
        try:
            with requests.post(f"{url}{self.path}", json=self.body, headers=self.headers, stream=True,
                               timeout=(10, READ_TIMEOUT_S)) as response:
                assert response.status_code == 200, response.text
                for line in response.iter_lines():
                    if line:
                        self.records.append(line)
                        self.started.set()
            self.ended = "complete"
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError) as error:
            self.ended = "timeout" if isinstance(error, requests.exceptions.ReadTimeout) else "closed"
        except requests.exceptions.Timeout:
            self.ended = "timeout"
        finally:
            self.started.set()


def requests_counted(url: str) -> float:
    """``llm_requests_total`` over every route, schema and status."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "llm_requests_total")


def gauge(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def worker_pids(server: RunningServer) -> set[int]:
    return {child.pid for child in psutil.Process(server.process.pid).children()}


def wait_for(predicate, attempts: int = 600) -> bool:
    """Poll ``predicate`` every 0.1 s, at most ``attempts`` times: a bound on waiting, not a speed requirement."""
    pause = threading.Event()
    for _ in range(attempts):
        if predicate():
            return True
        pause.wait(0.1)
    return predicate()


@pytest.fixture()
def server(tmp_path) -> RunningServer:
    running = start_server(tmp_path)
    yield running
    stop_server(running)


def test_a_worker_killed_mid_stream_closes_its_streams_and_is_replaced(server: RunningServer) -> None:
    url = server.url
    answered = [requests.post(f"{url}/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
                              timeout=120) for _ in range(3)]
    assert [response.status_code for response in answered] == [200] * 3
    assert wait_for(lambda: requests_counted(url) == 3)
    streams = [
        StreamClient("/invocations", {"inputs": "Count:", "parameters": LONG, "stream": True}),
        StreamClient("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count"}], "stream": True,
                                              "max_tokens": 4000, "ignore_eos": True}),
        StreamClient("/invocations", {"messages": [{"role": "user", "content": "Count"}], "stream": True,
                                      "max_tokens": 4000, "ignore_eos": True}),
        StreamClient("/invocations", {"inputs": "Count:", "parameters": LONG, "stream": True},
                     {"Accept": "text/event-stream"}),
    ]
    readers = [threading.Thread(target=stream.read, args=(url,)) for stream in streams]
    for reader in readers:
        reader.start()
    for stream in streams:
        assert stream.started.wait(120) and stream.records, "a stream never started"
    (worker,) = worker_pids(server)
    # a chat stream's first record (its role) comes before its first step: wait until all four hold a slot
    assert wait_for(lambda: gauge(url, "llm_running_requests") == len(streams))

    os.kill(worker, signal.SIGKILL)
    for reader in readers:
        reader.join(timeout=READ_TIMEOUT_S + 30)
    assert [stream.ended for stream in streams] == ["closed"] * len(streams)
    for stream in streams:  # no final record: the legacy stream's last line has no text, SSE has no [DONE]
        last = stream.records[-1]
        assert last != b"data: [DONE]"
        if not last.startswith(b"data: "):
            assert json.loads(last).get("generated_text") is None

    assert wait_for(lambda: len(worker_pids(server)) == 1 and worker not in worker_pids(server))
    wait_for_ping(url, server.process, server.log_path)
    assert server.process.poll() is None  # the master lived on
    assert requests_counted(url) == 3  # the dead worker's answered requests, once; its streams, never
    assert gauge(url, "llm_running_requests") == 0  # its live gauge went with it
    after = requests.post(f"{url}/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
                          timeout=120)
    assert after.status_code == 200
    assert wait_for(lambda: requests_counted(url) == 4)
