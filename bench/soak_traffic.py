"""The clients of ``bench.soak``: ordinary requests judged one by one, and the hostile pieces the other benches lack.

Reused, not copied: stalled and idle connections (``bench.slow_clients.Attackers``), slow image hosts
(``bench.hostile.slow_image_client``), disconnect storms (``bench.hostile.open_storm``), stream parsing
(``bench.load``), hostile JSON values (``tests.e2e.test_fuzz``), raw HTTP answers (``tests.e2e.test_transport``),
~7k-token prompts (``bench.kv_memory.text_of``). New here: the verdict on each ordinary request, malformed transport
requests in a loop, pixel-bomb requests, the /ping prober (run in a process of its own, so the soak's own threads
cannot delay a probe) and the sampler of each server's workers.

Every request is judged by one rule: *completed* (a 200 with a whole answer; a stream with its final record),
*refused* (a clear overload or deadline answer: 429, 503 or 504 with a JSON error; a stream ending with an error
record), or a failure: *hung* (no answer within the server's deadline plus ``HANG_MARGIN_S``), *broken* (the
connection failed, or a stream ended without a final record) or *wrong* (any other status, a malformed body).
"""

from __future__ import annotations

import base64
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import psutil
import requests

from bench.load import request_for, stream_records
from tests.e2e.test_fuzz import BIG_NUMBERS, CHAT_FIELDS, LEGACY_PARAMETERS, RAW_TOKENS, UNICODE_EDGES, put, serialise
from tests.e2e.test_transport import read_response
from tests.support.vision_fixture import png_bytes

HANG_MARGIN_S = 30.0           # past the server's request deadline, an unanswered request counts as hung
CLEAR_REFUSALS = {429, 503, 504}
ORDINARY_KINDS = ["chat-jsonl", "chat-sse", "chat-sse-invocations", "legacy-jsonl", "chat-plain", "legacy-plain"]
VISION_KINDS = ["vision-plain", "vision-sse"]
STREAMED_KINDS = {"chat-jsonl", "chat-sse", "chat-sse-invocations", "legacy-jsonl", "vision-sse"}


@dataclass
class Outcome:
    """One request's verdict (see the module docstring); ``at`` is seconds since the soak began."""

    server: str
    kind: str
    at: float
    seconds: float
    verdict: str
    status: int | None = None
    detail: str = ""


@dataclass
class Tally:
    """Every outcome, by all client threads."""

    epoch: float
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def now(self) -> float:
        return time.time() - self.epoch

    def as_dicts(self) -> list[dict]:
        with self.lock:
            return [asdict(outcome) for outcome in self.outcomes]


# ---- ordinary traffic -------------------------------------------------------------------------------------------
def ordinary_request(kind: str, index: int) -> tuple[str, dict, dict, bool]:
    """(path, body, headers, stream) for one ordinary request of ``kind``."""
    if kind in ("chat-plain", "legacy-plain"):
        path, body, headers = request_for("chat-sse" if kind == "chat-plain" else "legacy-jsonl", index, 16)
        return path, {**body, "stream": False}, headers, False
    path, body, headers = request_for(kind, index, 16)
    return path, body, headers, True


def vision_request(kind: str, index: int) -> tuple[str, dict, dict, bool]:
    """A chat with one small inline image (no fetch): the vision server's ordinary work."""
    image = "data:image/png;base64," + base64.b64encode(png_bytes(40 + index % 8, 40, (index % 250, 90, 160))).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": f"What is this? (#{index})"},
                                                      {"type": "image_url", "image_url": {"url": image}}]}],
            "max_tokens": 8, "stream": kind == "vision-sse"}
    return "/v1/chat/completions", body, {}, kind == "vision-sse"


def judge_stream(response: requests.Response) -> tuple[str, str]:
    """(verdict, detail) of a 200 stream read to its end."""
    sse = response.headers.get("Content-Type", "").startswith("text/event-stream")
    state: dict = {"done": False, "tail": b""}
    try:
        records = list(stream_records(response, sse, state))
    except ValueError as error:
        return "broken", str(error)
    if state["tail"] or not records or (sse and not state["done"]):
        return "broken", "no final record" if records else "empty stream"
    last = records[-1]
    if "error" in last or (last.get("token") or {}).get("id") == -1:
        return "refused", f"error record: {str(last.get('error'))[:100]}"
    final = last.get("generated_text") is not None or any(c.get("finish_reason") for c in last.get("choices") or [])
    return ("completed", "") if final else ("broken", "no final record")


def judge_answer(response: requests.Response) -> tuple[str, str]:
    """(verdict, detail) of a non-streaming answer, or of a stream refused before its first byte."""
    try:
        payload = response.json()
    except ValueError:
        return "wrong", f"{response.status_code}, not JSON: {response.text[:100]!r}"
    if response.status_code == 200:
        if isinstance(payload, dict) and (payload.get("choices") or payload.get("generated_text") is not None):
            return "completed", ""
        return "wrong", f"200 without an answer: {str(payload)[:100]}"
    if response.status_code in CLEAR_REFUSALS and isinstance(payload, dict) and "error" in payload:
        return "refused", str(response.status_code)
    return "wrong", f"{response.status_code}: {response.text[:120]}"


def send_and_judge(url: str, server: str, kind: str, request: tuple[str, dict, dict, bool], tally: Tally,
                   deadline_s: float) -> Outcome:
    path, body, headers, stream = request
    at, began = tally.now(), time.monotonic()
    status = None
    try:
        with requests.post(f"{url}{path}", json=body, headers=headers, stream=stream,
                           timeout=(10, deadline_s + HANG_MARGIN_S)) as response:
            status = response.status_code
            verdict, detail = judge_stream(response) if stream and status == 200 else judge_answer(response)
    except requests.Timeout as error:
        verdict, detail = "hung", type(error).__name__
    except requests.RequestException as error:
        verdict, detail = "broken", f"{type(error).__name__}: {str(error)[:100]}"
    seconds = time.monotonic() - began
    if verdict in ("completed", "refused") and seconds > deadline_s + HANG_MARGIN_S:
        verdict, detail = "hung", f"answered after {seconds:.0f} s"
    return Outcome(server, kind, at, round(seconds, 3), verdict, status, detail)


def ordinary_client(url: str, server: str, kinds: list[str], make: Callable, tally: Tally, stop: threading.Event,
                    deadline_s: float, offset: int) -> None:
    index = offset
    while not stop.is_set():
        kind = kinds[index % len(kinds)]
        tally.add(send_and_judge(url, server, kind, make(kind, index), tally, deadline_s))
        index += 1


# ---- hostile requests that are whole requests ----------------------------------------------------------------
def long_prompt_client(url: str, text: str, tally: Tally, stop: threading.Event, deadline_s: float) -> None:
    """~7k-token prompts, one after another, each with its own first words (no prefix-cache shortcut)."""
    index = 0
    while not stop.is_set():
        body = {"messages": [{"role": "user", "content": f"{index}. {text}"}], "max_tokens": 8}
        tally.add(send_and_judge(url, "text", "long-prompt", ("/v1/chat/completions", body, {}, False), tally,
                                 deadline_s))
        index += 1


def fuzzed_body(rng: random.Random) -> tuple[str, bytes]:
    """(path, raw body): a small valid chat or legacy body with one field given a hostile value."""
    values = [*UNICODE_EDGES, *BIG_NUMBERS, *(("raw", token) for token in RAW_TOKENS), None, True, [], {}, [[]],
              {"a": 1}, -1, 1e9, "x" * 5000]
    value, raw = put(rng.choice(values))
    if rng.random() < 0.5:
        field_name = rng.choice([f for f in CHAT_FIELDS if f not in ("max_tokens", "max_completion_tokens")])
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field_name: value}
        return rng.choice(["/invocations", "/v1/chat/completions"]), serialise(body, raw)
    name = rng.choice([p for p in LEGACY_PARAMETERS if p != "max_new_tokens"])
    return "/invocations", serialise({"inputs": "Hi", "parameters": {"max_new_tokens": 2, name: value}}, raw)


def fuzz_client(url: str, tally: Tally, stop: threading.Event, seed: int) -> None:
    """Fuzzed bodies: any 2xx or 4xx with a JSON body, or a clear refusal; never a 500, never a hang."""
    rng = random.Random(seed)
    while not stop.is_set():
        path, data = fuzzed_body(rng)
        at, began = tally.now(), time.monotonic()
        try:
            with requests.post(f"{url}{path}", data=data, headers={"Content-Type": "application/json"},
                               timeout=(10, 90)) as response:
                status, content = response.status_code, response.content
            ok = status < 500 or status in CLEAR_REFUSALS
            is_json = content[:1] in (b"{", b"[") or content.startswith(b"data: ")
            verdict = "completed" if ok and (status < 300 or is_json) else "wrong"
            detail = "" if verdict == "completed" else f"{status} for {data[:120]!r}: {content[:120]!r}"
        except requests.Timeout:
            status, verdict, detail = None, "hung", f"no answer to {data[:120]!r}"
        except requests.RequestException as error:
            status, verdict, detail = None, "broken", f"{type(error).__name__} for {data[:120]!r}"
        tally.add(Outcome("text", "fuzz", at, round(time.monotonic() - began, 3), verdict, status, detail))


# Raw requests gunicorn or the request reader must refuse with a JSON 4xx (501 for a transfer coding it lacks).
MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"GET /ping HTTP/9.x\r\nHost: x\r\n\r\n",
    b"GET /ping HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
    b"GET /ping HTTP/1.1\r\n\r\n",                                                     # no Host
    b"GET /invocations?q=" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",             # request line too long
    b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n",            # head over 64 KiB
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /invocations HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /invocations HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",                    # bare LF
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
]


def transport_client(address: tuple[str, int], tally: Tally, stop: threading.Event) -> None:
    index = 0
    while not stop.is_set():
        request = MALFORMED[index % len(MALFORMED)]
        index += 1
        at, began = tally.now(), time.monotonic()
        status, verdict, detail = None, "wrong", ""
        try:
            with socket.create_connection(address, timeout=30) as sock:
                sock.sendall(request)
                status, headers, body = read_response(sock)
            clear = 400 <= status < 500 or status in (501, 505)
            if clear and headers.get("content-type") == "application/json" and json.loads(body):
                verdict = "completed"
            else:
                detail = f"{status} for {request[:60]!r}: {body[:100]!r}"
        except (OSError, AssertionError, ValueError) as error:
            verdict, detail = ("hung" if isinstance(error, TimeoutError) else "broken"), f"{error!r}"[:160]
        tally.add(Outcome("text", "transport", at, round(time.monotonic() - began, 3), verdict, status, detail))
        stop.wait(0.2)


def pixel_bomb_client(url: str, bomb_url: str, tally: Tally, stop: threading.Event) -> None:
    """Eight 6000x6000 PNGs (each under every per-image limit) in one request: refused from their headers."""
    parts = [{"type": "image_url", "image_url": {"url": bomb_url}} for _ in range(8)]
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe."}, *parts]}],
            "max_tokens": 2}
    while not stop.is_set():
        at, began = tally.now(), time.monotonic()
        try:
            response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=(10, 120))
            code = (response.json().get("error") or {}).get("code") if response.status_code >= 400 else None
            refused = code in ("image_max_total_pixels", "image_memory_budget", "image_fetch_concurrency")
            verdict, detail = ("completed", str(code)) if refused else ("wrong", f"{response.status_code} {code}")
            status = response.status_code
        except (requests.RequestException, ValueError) as error:
            status, verdict, detail = None, "broken", type(error).__name__
        tally.add(Outcome("vision", "pixel-bomb", at, round(time.monotonic() - began, 3), verdict, status, detail))
        stop.wait(1.0)


# ---- measuring ------------------------------------------------------------------------------------------------
def probe_pings(urls: dict[str, str], seconds: float, every: float, epoch: float, sink) -> None:
    """In a process of its own: ``GET /ping`` on a fresh connection to each server every ``every`` seconds; sends
    back ``(server, at, latency or None)`` for each probe (None: not a 200 within 2 s)."""
    results: list[tuple[str, float, float | None]] = []
    end = time.monotonic() + seconds
    lock = threading.Lock()

    def probe(name: str, url: str) -> None:
        began = time.monotonic()
        try:
            ok = requests.get(f"{url}/ping", timeout=2, headers={"Connection": "close"}).status_code == 200
        except requests.RequestException:
            ok = False
        latency = time.monotonic() - began
        with lock:
            results.append((name, round(time.time() - epoch, 3), round(latency, 4) if ok and latency <= 2 else None))

    threads: list[threading.Thread] = []
    while time.monotonic() < end:
        tick = time.monotonic()
        for name, url in urls.items():  # each probe on its own thread: a slow one never delays the next
            threads.append(threading.Thread(target=probe, args=(name, url)))
            threads[-1].start()
        threads = [thread for thread in threads if thread.is_alive()]
        time.sleep(max(0.0, every - (time.monotonic() - tick)))
    for thread in threads:
        thread.join(timeout=5)
    sink.send(results)
    sink.close()


def kv_bytes(url: str) -> tuple[float | None, float | None]:
    """(KV-cache bytes allocated, the budget) from /metrics; Nones when it did not answer."""
    try:
        text = requests.get(f"{url}/metrics", timeout=5).text
    except requests.RequestException:
        return None, None
    values = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("llm_kv_cache_allocated_bytes ", "llm_kv_cache_budget_bytes "))}
    return values.get("llm_kv_cache_allocated_bytes"), values.get("llm_kv_cache_budget_bytes")


def sample_workers(servers: dict[str, tuple[int, str]], every: float, epoch: float, stop: threading.Event,
                   samples: list[dict]) -> None:
    """Each server's worker processes every ``every`` seconds: RSS (MB), open file descriptors, threads, and the
    KV cache the engine has allocated (MB; it grows with the load up to its budget, and is part of the RSS)."""
    while not stop.is_set():
        for name, (master, url) in servers.items():
            try:
                workers = psutil.Process(master).children()
            except psutil.Error:
                continue
            allocated, budget = kv_bytes(url)
            for worker in workers:
                try:
                    with worker.oneshot():
                        samples.append({"server": name, "pid": worker.pid, "at": round(time.time() - epoch, 2),
                                        "rss_mb": round(worker.memory_info().rss / 2**20, 1),
                                        "fds": worker.num_fds(), "threads": worker.num_threads(),
                                        "kv_mb": None if allocated is None else round(allocated / 2**20, 1),
                                        "kv_budget_mb": None if budget is None else round(budget / 2**20, 1)})
                except psutil.Error:
                    pass
        stop.wait(every)
