"""Soak test: N concurrent streaming clients for S seconds against the real server, with bad requests and mid-stream
disconnects mixed in at a fixed rate, checking that nothing is lost, duplicated or malformed and that memory stays
flat.

Starts ``python -m handler serve`` (gunicorn, embedded model) on a free loopback port (bench.run's helpers). Each
client loops until the deadline; request number k (global, in order of sending) is
  - a bad request (an invalid body, a 400 expected) when k % --bad-every == 0,
  - a stream closed after a few lines when k % --disconnect-every == 0,
  - else a full stream, rotating chat JSON lines on /invocations, chat SSE on /v1/chat/completions, chat SSE on
    /invocations (Accept: text/event-stream) and legacy JSON lines on /invocations.
Checks: every request sent is answered (a status line came back) and its X-Request-Id is seen once; the server's
request log has exactly one line per request id; every completed stream is well formed (each line JSON ending in
a newline, the last chat chunk has a finish_reason, the legacy stream ends with generated_text, SSE ends with
``data: [DONE]``); RSS of the server's processes (sampled every --sample-every s) ends within the tolerance of its
value after warm-up. Bounded in clients and time; loopback only.

    python -m bench.load [--clients 16] [--seconds 120]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import requests

from bench.run import ROOT, TOPICS, pct, rss_mb, start, stop

MAX_CLIENTS = 64
MAX_SECONDS = 3600
BAD_BODIES = [
    b"{",                                                                     # not JSON
    b"[1, 2, 3]",                                                             # not an object
    json.dumps({"messages": []}).encode(),                                    # empty messages
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 9}).encode(),  # out of range
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "bogus": 1}).encode(),         # unknown field
    json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 0}}).encode(),                 # legacy range
    json.dumps({"neither": True}).encode(),                                   # no schema field
    b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',       # NaN literal
]
STREAM_KINDS = ["chat-jsonl", "chat-sse", "chat-sse-invocations", "legacy-jsonl"]


@dataclass
class Outcome:
    kind: str
    status: int | None = None
    request_id: str | None = None
    latency: float | None = None
    error: str | None = None  # None: as expected


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    counter: itertools.count = field(default_factory=itertools.count)
    sent: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    def next_index(self) -> int:
        with self.lock:
            self.sent += 1
            return next(self.counter)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)


def chat_body(index: int, max_tokens: int) -> dict:
    topic = TOPICS[index % len(TOPICS)]
    return {"messages": [{"role": "user", "content": f"Write one sentence about {topic} (#{index})."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}


def legacy_body(index: int, max_tokens: int) -> dict:
    return {"inputs": f"A sentence about {TOPICS[index % len(TOPICS)]}:",
            "parameters": {"max_new_tokens": max_tokens}, "stream": True}


def request_for(kind: str, index: int, max_tokens: int) -> tuple[str, dict, dict]:
    if kind == "chat-jsonl":
        return "/invocations", chat_body(index, max_tokens), {}
    if kind == "chat-sse":
        return "/v1/chat/completions", chat_body(index, max_tokens), {}
    if kind == "chat-sse-invocations":
        return "/invocations", chat_body(index, max_tokens), {"Accept": "text/event-stream"}
    return "/invocations", legacy_body(index, max_tokens), {}


def check_stream(kind: str, response: requests.Response, close_after: int | None) -> str | None:
    """Read a stream; return what is wrong, or None. With close_after: stop (and close) after that many records."""
    sse = response.headers.get("Content-Type", "").startswith("text/event-stream")
    if sse != kind.startswith("chat-sse"):
        return f"framing {response.headers.get('Content-Type')!r} for {kind}"
    records: list[dict] = []
    state = {"done": False, "tail": b""}
    try:
        for record in stream_records(response, sse, state):
            records.append(record)
            if close_after is not None and len(records) >= close_after:
                return None  # mid-stream disconnect: the caller's context manager closes the socket
    except ValueError as error:
        return str(error)
    if state["tail"]:
        return f"stream does not end in a newline: {state['tail'][-80:]!r}"
    if sse and not state["done"]:
        return "SSE stream without data: [DONE]"
    return check_last_record(kind, records, response.headers.get("X-Request-Id"))


def stream_records(response: requests.Response, sse: bool, state: dict) -> Iterator[dict]:
    """The records of a JSON-lines or SSE stream; ValueError for a malformed line. ``state`` gets ``done`` (SSE's
    [DONE] seen) and ``tail`` (bytes after the last newline)."""
    buffer = b""
    for piece in response.iter_content(chunk_size=None):
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line:
                if not sse:
                    raise ValueError("empty JSON line")
                continue
            text = line.decode("utf-8")
            if sse:
                if not text.startswith("data: "):
                    raise ValueError(f"bad SSE line {text[:80]!r}")
                text = text[6:]
                if text == "[DONE]":
                    state["done"] = True
                    continue
            if state["done"]:
                raise ValueError("data after [DONE]")
            try:
                yield json.loads(text)
            except ValueError:
                raise ValueError(f"line is not JSON: {text[:80]!r}") from None
    state["tail"] = buffer


def check_last_record(kind: str, records: list[dict], request_id: str | None) -> str | None:
    if not records:
        return "empty stream"
    last = records[-1]
    if "error" in last:
        return f"stream ended with an error record: {str(last['error'])[:120]}"
    if kind.startswith("legacy"):
        return None if last.get("generated_text") is not None else "legacy stream ends without generated_text"
    ids = {r.get("id") for r in records}
    if ids != {request_id}:
        return f"chunk ids {sorted(map(str, ids))[:3]} differ from X-Request-Id {request_id}"
    if not any(c.get("finish_reason") for c in last.get("choices") or []):
        return "last chat chunk has no finish_reason"
    return None


def one_request(url: str, index: int, args: argparse.Namespace) -> Outcome:
    if index % args.bad_every == 0:
        kind, path, headers = "bad", ("/invocations", "/v1/chat/completions")[index % 2], {}
        data = BAD_BODIES[(index // args.bad_every) % len(BAD_BODIES)]
    else:
        disconnect = index % args.disconnect_every == 0
        stream_kind = STREAM_KINDS[index % len(STREAM_KINDS)]
        kind = "disconnect" if disconnect else stream_kind
        path, body, headers = request_for(stream_kind, index, args.max_tokens)
        data = json.dumps(body).encode()
    outcome = Outcome(kind)
    start_t = time.perf_counter()
    try:
        with requests.post(f"{url}{path}", data=data, timeout=args.timeout, stream=True,
                           headers={"Content-Type": "application/json", **headers}) as response:
            outcome.status = response.status_code
            outcome.request_id = response.headers.get("X-Request-Id")
            if kind == "bad":
                payload = response.json()
                if response.status_code != 400 or "error" not in payload:
                    outcome.error = f"bad request answered {response.status_code}: {response.text[:120]}"
            elif response.status_code != 200:
                outcome.error = f"status {response.status_code}: {response.text[:120]}"
            else:
                close_after = args.disconnect_after if kind == "disconnect" else None
                outcome.error = check_stream(stream_kind, response, close_after)
    except (requests.RequestException, ValueError) as error:
        outcome.error = f"{type(error).__name__}: {str(error)[:120]}"
    outcome.latency = time.perf_counter() - start_t
    if outcome.request_id is None and outcome.status is not None:
        outcome.error = outcome.error or "no X-Request-Id"
    return outcome


def sample_rss(pid: int, every: float, stop_event: threading.Event, samples: list[tuple[float, float]]) -> None:
    t0 = time.monotonic()
    while not stop_event.is_set():
        samples.append((time.monotonic() - t0, rss_mb(pid)))
        stop_event.wait(every)


def server_log_ids(log_text: str) -> collections.Counter:
    """request_id -> how many request lines the server logged for it."""
    counts: collections.Counter = collections.Counter()
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "request":
            counts[record.get("request_id")] += 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per streamed request")
    parser.add_argument("--bad-every", type=int, default=7, help="every k-th request is an invalid body")
    parser.add_argument("--disconnect-every", type=int, default=5, help="every k-th stream is closed early")
    parser.add_argument("--disconnect-after", type=int, default=3, help="records read before closing")
    parser.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before RSS is baselined")
    parser.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed growth after warm-up")
    parser.add_argument("--timeout", type=float, default=120, help="client read timeout per request")
    args = parser.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS or not 1 <= args.seconds <= MAX_SECONDS:
        parser.error(f"--clients must be 1..{MAX_CLIENTS} and --seconds 1..{MAX_SECONDS}")

    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    log_path = out / "load-server.log"
    process, url, ready_s = start([sys.executable, "-m", "handler", "serve"], {}, log_path)
    if not url.startswith("http://127.0.0.1:"):
        raise SystemExit("loopback only")
    print(f"server: /ping 200 in {ready_s:.1f} s; idle RSS {rss_mb(process.pid):.0f} MB; "
          f"{args.clients} clients for {args.seconds:.0f} s", flush=True)

    tally, rss_samples, stop_event = Tally(), [], threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(process.pid, args.sample_every, stop_event, rss_samples),
                               daemon=True)
    deadline = time.monotonic() + args.seconds

    def client() -> None:
        while time.monotonic() < deadline:
            tally.add(one_request(url, tally.next_index(), args))

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    t0 = time.perf_counter()
    try:
        sampler.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - t0
        time.sleep(2.0)  # let the server write the request lines of the last (and the aborted) requests
        stop_event.set()
        sampler.join()
        alive = requests.get(f"{url}/ping", timeout=10).status_code == 200
    finally:
        stop(process)
    return report(args, tally, rss_samples, wall, alive, server_log_ids(log_path.read_text(errors="replace")))


def print_latencies(outcomes: list[Outcome]) -> None:
    for kind in ["bad", "disconnect", *STREAM_KINDS]:
        lat = [o.latency for o in outcomes if o.kind == kind and not o.error and o.latency is not None]
        if lat:
            print(f"  {kind:22s} n={len(lat):5d}  p50 {pct(lat, 0.5) * 1000:7.0f} ms  "
                  f"p99 {pct(lat, 0.99) * 1000:7.0f} ms")


def report(args, tally: Tally, rss_samples: list[tuple[float, float]], wall: float, alive: bool,
           logged: collections.Counter) -> int:
    outcomes = tally.outcomes
    failures: list[str] = []
    answered = [o for o in outcomes if o.status is not None]
    ids = collections.Counter(o.request_id for o in answered if o.request_id)
    dup_ids = [i for i, c in ids.items() if c > 1]
    not_logged = [i for i in ids if logged.get(i, 0) == 0]
    logged_twice = [i for i in ids if logged.get(i, 0) > 1]
    by_kind = collections.Counter(o.kind for o in outcomes)
    errors = collections.Counter(f"{o.kind}: {o.error.split(':')[0]}" for o in outcomes if o.error)

    print(f"requests sent {tally.sent}, answered {len(answered)}, completed {len(outcomes)} in {wall:.1f} s "
          f"({len(outcomes) / wall:.1f} req/s)")
    print("by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())))
    print_latencies(outcomes)
    full = [o.latency for o in outcomes if o.kind in STREAM_KINDS and not o.error]
    print(f"full streams: p50 {pct(full, 0.5) * 1000:.0f} ms, p99 {pct(full, 0.99) * 1000:.0f} ms")
    print("errors by kind: " + (", ".join(f"{k} x{v}" for k, v in errors.most_common()) or "none"))
    for o in [o for o in outcomes if o.error][:5]:
        print(f"  e.g. {o.kind} {o.status} {o.request_id}: {o.error}")
    print(f"request ids: {len(ids)} distinct, {len(dup_ids)} duplicated; server log: {sum(logged.values())} request "
          f"lines, {len(not_logged)} answered ids missing, {len(logged_twice)} logged twice")

    warm_at = args.seconds * args.warmup
    after = [mb for t, mb in rss_samples if t >= warm_at] or [mb for _, mb in rss_samples]
    rss_start, rss_end, rss_max = after[0], after[-1], max(mb for _, mb in rss_samples)
    growth = (rss_end - rss_start) / rss_start
    print(f"RSS (MB, {len(rss_samples)} samples every {args.sample_every:g} s): first {rss_samples[0][1]:.0f}, "
          f"after warm-up {rss_start:.0f}, end {rss_end:.0f}, max {rss_max:.0f} ({growth * 100:+.1f}% after warm-up)")

    if tally.sent != len(outcomes):
        failures.append(f"sent {tally.sent} but finished {len(outcomes)}")
    if len(answered) != len(outcomes):
        failures.append(f"{len(outcomes) - len(answered)} requests got no answer")
    if dup_ids:
        failures.append(f"duplicated request ids: {dup_ids[:3]}")
    if not_logged or logged_twice:
        failures.append(f"server log mismatch: missing {not_logged[:3]}, twice {logged_twice[:3]}")
    if errors:
        failures.append(f"{sum(errors.values())} requests went wrong")
    if growth > args.rss_tolerance:
        failures.append(f"RSS grew {growth * 100:.1f}% after warm-up")
    if not alive:
        failures.append("/ping not 200 after the run")
    print("RESULT: " + ("PASS" if not failures else "FAIL - " + "; ".join(failures)))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
