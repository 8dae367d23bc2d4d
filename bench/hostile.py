"""Issue #17's scenario: hostile and unlucky traffic at once, while /ping and a normal chat are measured.

Serves a tiny vision-language model (``tests.support.vision_fixture``, built locally) on a free loopback port, with a
loopback image server that answers after --image-delay seconds allow-listed
(``tests.support.vision_fixture.SlowImageServer``).
Then, for --seconds:
  - --stalled connections trickle a request head one byte every 2 s and --idle ones send nothing, re-opened as soon
    as the server closes them (``bench.slow_clients.Attackers``);
  - --slow-images concurrent chat requests each point at the slow image server, re-sent as soon as one ends;
  - /ping is probed on a fresh connection every 0.25 s (a success is a 200 within 2 s), and a small text chat is
    sent every 2 s (its latency recorded);
  - the gunicorn worker's RSS is sampled every 0.2 s.
Afterwards: two disconnect storms (--storm long streams, then --storm long non-streaming requests, opened and then
dropped at once) and the seconds until no request holds or waits for a batch slot (None: still held after 120 s).
Prints one JSON object. Loopback only.

    python -m bench.hostile [--stalled 300] [--idle 0] [--slow-images 130] [--seconds 60] [--storm 200]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

from bench.slow_clients import Attackers
from tests.e2e.conftest import start_tiny_vlm, stop_server
from tests.support.vision_fixture import SlowImageServer


def worker_pid(master_pid: int) -> int | None:
    children = psutil.Process(master_pid).children()
    return children[0].pid if children else None


def sample_rss(master_pid: int, stop: threading.Event, samples: list[float], workers: set[int]) -> None:
    """The worker's RSS every 0.2 s; a worker that died and was replaced is followed (its pid lands in ``workers``)."""
    while not stop.is_set():
        try:
            pid = worker_pid(master_pid)
            if pid is not None:
                workers.add(pid)
                samples.append(psutil.Process(pid).memory_info().rss / 2**20)
        except psutil.Error:
            pass
        stop.wait(0.2)


def slow_image_client(url: str, image_url: str, stop: threading.Event, statuses: list) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                      {"type": "image_url", "image_url": {"url": image_url}}]}],
            "max_tokens": 2}
    while not stop.is_set():
        try:
            statuses.append(requests.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code)
        except requests.RequestException as error:
            statuses.append(type(error).__name__)


def probe(url: str, seconds: float) -> dict:
    pings: list[float | None] = []   # latency of each /ping, None for a miss
    chats: list[float | None] = []
    chat_body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}

    def chat() -> None:
        started = time.monotonic()
        try:
            ok = requests.post(f"{url}/v1/chat/completions", json=chat_body, timeout=60).status_code == 200
        except requests.RequestException:
            ok = False
        chats.append(time.monotonic() - started if ok else None)

    threads, end, next_chat = [], time.monotonic() + seconds, 0.0
    while time.monotonic() < end:
        started = time.monotonic()
        if started >= next_chat:
            next_chat = started + 2
            threads.append(threading.Thread(target=chat, daemon=True))
            threads[-1].start()
        try:
            ok = requests.get(f"{url}/ping", timeout=2, headers={"Connection": "close"}).status_code == 200
        except requests.RequestException:
            ok = False
        latency = time.monotonic() - started
        pings.append(latency if ok and latency <= 2 else None)
        time.sleep(max(0.0, 0.25 - latency))
    for thread in threads:
        thread.join(timeout=65)
    answered = sorted(p for p in pings if p is not None)
    chat_ok = sorted(c for c in chats if c is not None)
    return {
        "pings": len(pings), "pings_ok": len(answered),
        "ping_p99_ms": round(1e3 * answered[int(0.99 * (len(answered) - 1))], 1) if answered else None,
        "chats": len(chats), "chats_ok": len(chat_ok),
        "chat_p50_s": round(statistics.median(chat_ok), 3) if chat_ok else None,
        "chat_max_s": round(chat_ok[-1], 3) if chat_ok else None,
    }


def running_requests(url: str) -> float:
    """Requests holding or waiting for batch slots (``llm_running_requests + llm_waiting_requests``), or NaN when
    /metrics does not answer within 10 s."""
    try:
        text = requests.get(f"{url}/metrics", timeout=10).text
    except requests.RequestException:
        return float("nan")
    names = ("llm_running_requests", "llm_waiting_requests")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names))


def open_storm(url: str, count: int, stream: bool) -> list[socket.socket]:
    """``count`` connections, each with a long request sent (a stream, or a non-streaming one, which writes nothing
    until done) and nothing read: dropping them all at once is the storm."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"inputs": "Count:", "stream": stream,
                       "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}).encode()
    request = (b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(request)
        sockets.append(sock)
    return sockets


def disconnect_storm(url: str, count: int, stream: bool) -> dict:
    """``count`` long requests (streams, or non-streaming ones) opened, then all dropped at once: seconds until no
    request holds or waits for a slot."""
    sockets = open_storm(url, count, stream)
    deadline = time.monotonic() + 60
    while not running_requests(url) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    held = running_requests(url)
    dropped = time.monotonic()
    for sock in sockets:
        sock.close()
    freed_at, zeros = None, 0
    while zeros < 10 and time.monotonic() - dropped < 120:  # zero for a whole second: all of them are gone
        zeros = zeros + 1 if running_requests(url) == 0 else 0
        freed_at = freed_at if zeros > 1 else time.monotonic()
        time.sleep(0.1)
    kind = "stream" if stream else "plain"
    return {f"storm_{kind}_in_engine_before_drop": held,
            f"storm_{kind}_seconds_to_free_slots": round(freed_at - dropped, 2) if zeros >= 10 else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stalled", type=int, default=300)
    parser.add_argument("--idle", type=int, default=0)
    parser.add_argument("--slow-images", type=int, default=130)
    parser.add_argument("--image-delay", type=float, default=60.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--storm", type=int, default=200)
    parser.add_argument("--env", nargs="*", default=[], help="KEY=VALUE settings for the server")
    args = parser.parse_args()
    slow = SlowImageServer()
    slow_url = slow.url(f"sleep/{args.image_delay:g}/0")  # a small PNG, after --image-delay seconds
    with tempfile.TemporaryDirectory() as tmp:
        server = start_tiny_vlm(Path(tmp), dict(item.split("=", 1) for item in args.env))
        try:
            rss: list[float] = []
            workers: set[int] = set()
            stop, sampling = threading.Event(), threading.Event()
            threading.Thread(target=sample_rss, args=(server.process.pid, sampling, rss, workers), daemon=True).start()
            host, port = server.url.removeprefix("http://").split(":")
            attackers = Attackers(host, int(port), args.stalled, args.idle, 2.0)
            threading.Thread(target=attackers.run, daemon=True).start()
            statuses: list = []
            for _ in range(args.slow_images):
                threading.Thread(target=slow_image_client, args=(server.url, slow_url, stop, statuses),
                                 daemon=True).start()
            time.sleep(3)
            result = probe(server.url, args.seconds)
            stop.set()
            attackers.close()
            time.sleep(5)
            result["rss_idle_mb"] = round(rss[0]) if rss else None
            result["rss_peak_mb"] = round(max(rss)) if rss else None
            result["rss_after_mb"] = round(rss[-1]) if rss else None
            result["worker_pids_seen"] = len(workers)  # more than 1: the worker died and was replaced
            names = [str(status) for status in statuses]
            result["slow_image_statuses"] = {name: names.count(name) for name in sorted(set(names))}
            for stream in (True, False) if args.storm else ():
                result.update(disconnect_storm(server.url, args.storm, stream))
            sampling.set()
            result.update(stalled=args.stalled, idle=args.idle, slow_images=args.slow_images, env=args.env)
        finally:
            stop_server(server)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
