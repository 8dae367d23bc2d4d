"""SIGTERM through the real gunicorn process: /ping turns 503, new work is refused, in-flight work finishes, exit 0."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import requests

from tests.e2e.conftest import metric, start_server, stop_server


def test_sigterm_drains_in_flight_requests_and_exits_zero(tmp_path):
    server = start_server(tmp_path)
    lines: list[dict] = []

    def stream() -> None:
        body = {"inputs": "Count to a hundred:", "parameters": {"max_new_tokens": 24, "ignore_eos": True},
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
        assert lines[-1]["generated_text"] is not None and len(lines) == 24
        assert server.process.wait(timeout=40) == 0
        log = server.log()
        assert not error_lines(log), log[-3000:]  # a planned stop is not an error
        assert "lean engine stopped" in log or "vLLM engine shut down" in log, log[-3000:]
    finally:
        stop_server(server)
        reader.join(timeout=5)


def error_lines(log: str) -> list[str]:
    """Lines logged at ERROR (ours and gunicorn's format), tracebacks and dead threads."""
    return [line for line in log.splitlines()
            if " ERROR " in line or "[ERROR]" in line or line.startswith(("Traceback", "Exception in thread"))]


def _read_stream(url: str, body: dict, headers: dict, sink: list) -> None:
    with requests.post(f"{url}/invocations", json=body, headers=headers, stream=True, timeout=120) as response:
        sink.extend(line for line in response.iter_lines() if line)


def test_streams_still_running_when_the_grace_ends_get_a_final_record_and_a_log_line(tmp_path):
    """SERVER_GRACEFUL_TIMEOUT=5: the drain waits 2 s, then the engine ends what still runs; each stream's last
    record is its error record (legacy: token id -1 and finish reason error; SSE chat: an error object, then
    [DONE]), each request is logged, and the worker still exits 0. OPTION_REQUEST_TIMEOUT=600, and why: the
    default 60 s request deadline is the other way such a stream ends with a tokenless last record (its text so
    far), and one CI run of the vLLM contract ended the legacy stream that way, once in many; with the deadline
    out of reach, a stream the grace period fails to end shows here as itself (the message says when it ended)."""
    server = start_server(tmp_path, {"SERVER_GRACEFUL_TIMEOUT": "5", "OPTION_REQUEST_TIMEOUT": "600"})
    legacy: list[bytes] = []
    chat: list[bytes] = []
    long = {"max_new_tokens": 4000, "ignore_eos": True}
    readers = [
        threading.Thread(target=_read_stream, args=(server.url, {"inputs": "Count:", "parameters": long,
                                                                  "stream": True}, {}, legacy)),
        threading.Thread(target=_read_stream, args=(server.url, {"messages": [{"role": "user", "content": "Count"}],
                                                                  "max_tokens": 4000, "ignore_eos": True,
                                                                  "stream": True},
                                                    {"Accept": "text/event-stream"}, chat)),
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 60
        while not (legacy and chat) and time.monotonic() < deadline:  # both streams run before the signal
            time.sleep(0.05)
        assert legacy and chat, "the streams never started"
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(timeout=60)
        ended = f"{time.monotonic() - signalled:.1f} s after SIGTERM; log: {server.log()[-2000:]}"
        last = json.loads(legacy[-1])
        assert last["token"]["id"] == -1 and last["details"]["finish_reason"] == "error", (last, ended)
        assert "grace period" in last["error"]
        assert chat[-1] == b"data: [DONE]"
        error = json.loads(chat[-2].removeprefix(b"data: "))["error"]
        assert error["type"] == "service_unavailable" and "grace period" in error["message"]
        assert server.process.wait(timeout=40) == 0
        log = server.log()
        assert "ending 2 requests still in flight" in log
        logged = [json.loads(line) for line in log.splitlines() if line.startswith("{") and '"route"' in line]
        assert sum(entry.get("route") == "/invocations" for entry in logged) >= 2, log[-3000:]
    finally:
        stop_server(server)
        for reader in readers:
            reader.join(timeout=5)


def test_a_client_that_disconnects_frees_its_slot_without_writing(tmp_path):
    """A non-streaming request writes nothing until its answer is ready, so only the watcher can notice its client
    closing: the request ends aborted after a few tokens instead of generating all 4000, and the request log says
    why. A legacy batch first (its one socket watched for two generations) leaves the watcher working, with no
    thread's traceback in the log: such a batch once killed the watcher, and hung-up requests then ran to their
    end."""
    server = start_server(tmp_path)
    try:
        batch = requests.post(f"{server.url}/invocations", timeout=120, json={
            "inputs": ["The capital of France is", "The capital of Italy is"], "parameters": {"max_new_tokens": 4}})
        assert batch.status_code == 200 and len(batch.json()) == 2
        legacy = {"inputs": "Count:", "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}
        chat = {"messages": [{"role": "user", "content": "Count to ten thousand."}], "max_tokens": 4000,
                "ignore_eos": True}
        sockets = []
        for payload in (legacy, legacy, chat):
            body = json.dumps(payload).encode()
            sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10)
            sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            sockets.append(sock)
        deadline = time.monotonic() + 60
        while metric(server.url, "llm_running_requests") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        for sock in sockets:
            sock.close()
        deadline = time.monotonic() + 60  # generous; 4000 tokens each would take minutes
        while metric(server.url, "llm_running_requests") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(server.url, "llm_running_requests") == 0
    finally:
        stop_server(server)
    log = server.log()
    logged = [json.loads(line) for line in log.splitlines() if line.startswith("{") and '"route"' in line]
    aborted = [entry for entry in logged if entry.get("route") == "/invocations" and entry.get("cancelled")]
    assert len(aborted) == 3, log[-3000:]
    assert all(entry["completion_tokens"] < 4000 for entry in aborted), aborted
    assert {entry["schema"] for entry in aborted} == {"legacy", "chat"}
    assert all(entry["cancelled"] == "client closed the connection" for entry in aborted)
    assert not [line for line in error_lines(log) if "Exception in thread" in line or "Traceback" in line], log[-3000:]

