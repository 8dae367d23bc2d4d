"""Does ``/invocations-bidirectional-stream`` accept within SageMaker's 250 ms while the server is busy?

Starts ``python -m handler serve`` (embedded model) on a free loopback port with few request threads
(``SAGEMAKER_MODEL_SERVER_THREADS``, default 4), keeps --busy non-streaming generations in flight (more than the
threads: the rest wait for a thread in the worker's queue) and --streams streaming ones, and meanwhile opens
--connections WebSockets one after another, timing each from the TCP connect to the 101 read by the client, and
sends --http-probes ``GET /v1/models`` on fresh connections (a request that needs a request thread) for comparison.
Loopback only.

    python -m bench.bidi_accept [--busy 16] [--streams 8] [--connections 50] [--http-probes 3] [--threads 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests
from websockets.sync.client import connect

from tests.e2e.conftest import start_server, stop_server

LONG = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}], "max_tokens": 256,
        "ignore_eos": True}


def keep_busy(url: str, stream: bool, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            requests.post(f"{url}/v1/chat/completions", json={**LONG, "stream": stream}, timeout=300).close()
        except requests.RequestException:
            pass


def summary(seconds: list[float]) -> str:
    ms = sorted(s * 1e3 for s in seconds)
    return (f"p50 {statistics.median(ms):.1f} ms, p90 {ms[int(len(ms) * 0.9)]:.1f} ms, max {ms[-1]:.1f} ms "
            f"({len(ms)})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--busy", type=int, default=16)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--http-probes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    server = start_server(Path(tempfile.mkdtemp(prefix="bidi-accept-")),
                          {"SAGEMAKER_MODEL_SERVER_THREADS": str(args.threads)})
    stop = threading.Event()
    try:
        url, ws_url = server.url, server.url.replace("http://", "ws://") + "/invocations-bidirectional-stream"
        load = [threading.Thread(target=keep_busy, args=(url, i < args.streams, stop), daemon=True)
                for i in range(args.busy + args.streams)]
        for thread in load:
            thread.start()
        time.sleep(5)  # the generations are running and the request threads taken
        accepts, models = [], []
        for _ in range(args.connections):
            start = time.perf_counter()
            with connect(ws_url, open_timeout=60):
                accepts.append(time.perf_counter() - start)
            time.sleep(0.2)
        for _ in range(args.http_probes):
            start = time.perf_counter()
            requests.get(f"{url}/v1/models", timeout=600)
            models.append(time.perf_counter() - start)
        print(f"under load ({args.busy} non-streaming + {args.streams} streaming generations, {args.threads} "
              "request threads):")
        print(f"  WebSocket accept (connect to 101): {summary(accepts)}")
        print(f"  GET /v1/models (needs a request thread): {summary(models)}")
    finally:
        stop.set()
        stop_server(server)


if __name__ == "__main__":
    main()
