"""Throughput and latency of the real server against a naive lock-around-generate baseline, in one run.

Starts ``python -m handler serve`` (gunicorn, embedded model) on a free loopback port, drives 1, 4, 16 and 32
concurrent clients (chat schema on /invocations, greedy, ignore_eos, 64 new tokens, distinct prompts), first
non-streaming then streaming (JSON lines), and prints aggregate tokens/s, TTFT, inter-token latency, request latency
and the worker's RSS. Then the same load against bench/baseline_server.py (transformers ``generate`` under a lock)
and the ratios. Bounded: each client sends ``--requests`` requests per level. Loopback only.

    make bench            # or: python -m bench.run [--levels 1,4,16,32] [--baseline-levels 1,4,16]

``--llama-cpp`` also serves the same model as a Q8_0 GGUF through llama.cpp's own server (``bench.llama_cpp``; built
by ``make llama-cpp``, never in CI) under the same load, on its chat route, and adds an ours-vs-llama.cpp table.
``--long-prompts N`` adds a prefill-heavy level to every server: N concurrent streams of ~1k-token prompts
(16 new tokens each), reported as TTFT p50/p95.

Every table names the CPU (``bench.machine``: model name, AVX2 / AVX-512 / AMX flags, and any setting that holds the
run to AVX2). ``python -m bench.long_prompts`` measures long prompts (1k-8k tokens, eight 7k-token prompts beside a
short chat) against llama.cpp.

``--backend vllm`` also serves the same model through the vLLM backend (``option.rolling_batch=vllm``, from
``.venv-vllm``: ``make venv-vllm``), drives it with the same load in the same run, and adds a lean-vs-vLLM table:
tok/s, TTFT, start time and RSS (all of vLLM's processes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from bench.machine import cpu_label

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "model_store" / "smollm2-135m-instruct"
TOPICS = ["the sea", "a lighthouse", "a clock", "autumn", "a cat", "the moon", "bread", "a river", "mountains",
          "a library", "rain", "a violin", "trains", "a garden", "snow", "the desert", "a market", "bees",
          "a bridge", "coffee", "a forest", "stars", "a kite", "the wind", "a harbour", "lanterns", "an owl",
          "a map", "salt", "a comet", "tea", "a canyon"]


@dataclass
class Sample:
    latency: float
    tokens: int
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 600, ready_path: str = "/ping") -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if requests.get(f"{url}{ready_path}", timeout=2).status_code == 200:
                return time.monotonic() - start
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise RuntimeError("server not ready")


@dataclass(frozen=True)
class Route:
    """Where a server takes the chat requests of the load: ours on /invocations (JSON lines when streaming), llama.cpp
    on its OpenAI route (server-sent events)."""

    path: str = "/invocations"
    sse: bool = False


OURS = Route()
LONG_PROMPT_TOKENS = 16  # new tokens per long-prompt request: the level measures prefill (TTFT)


def body(index: int, stream: bool, long_prompt: bool = False) -> dict:
    topic = TOPICS[index % len(TOPICS)]
    if long_prompt:
        return {"messages": [{"role": "user", "content": long_text(index) + f"\nSummarise the notes on {topic}."}],
                "max_tokens": LONG_PROMPT_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    return {"messages": [{"role": "user", "content": f"Write a short poem about {topic} (#{index})."}],
            "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": stream}


def long_text(index: int) -> str:
    """About 1,000 tokens of notes, distinct per request from the first sentence on (no shared prefix to cache
    beyond the chat template's)."""
    moods = ["calm", "bright", "strange", "busy"]
    lines = [f"Note {index}.{k}: the {TOPICS[(index + k) % len(TOPICS)]} was observed at {k * 7 % 24:02d}:"
             f"{k * 13 % 60:02d} by observer {index * 31 + k}, who wrote that it looked {moods[k % 4]}."
             for k in range(30)]
    return "\n".join(lines)


def stream_chunks(response: requests.Response, sse: bool):
    """The JSON chunks of a streamed answer: JSON lines, or server-sent events up to ``[DONE]``."""
    for line in response.iter_lines():
        if sse:
            if not line.startswith(b"data: "):
                continue
            line = line[len(b"data: "):]
            if line == b"[DONE]":
                return
        yield json.loads(line)


def one_request(url: str, index: int, stream: bool, route: Route = OURS, long_prompt: bool = False) -> Sample:
    start = time.perf_counter()
    expected = LONG_PROMPT_TOKENS if long_prompt else 64
    if not stream:
        response = requests.post(f"{url}{route.path}", json=body(index, False, long_prompt), timeout=600)
        response.raise_for_status()
        tokens = response.json()["usage"]["completion_tokens"]
        if tokens != expected:
            raise RuntimeError(f"{url}: {tokens} tokens generated, not {expected}: ignore_eos was not honoured")
        return Sample(time.perf_counter() - start, tokens)
    sample, last = Sample(0.0, 0), None
    with requests.post(f"{url}{route.path}", json=body(index, True, long_prompt), timeout=600,
                       stream=True) as response:
        response.raise_for_status()
        for chunk in stream_chunks(response, route.sse):
            if not chunk.get("choices") or not chunk["choices"][0]["delta"].get("content"):
                continue
            now = time.perf_counter()
            sample.ttft = now - start if sample.ttft is None else sample.ttft
            if last is not None:
                sample.gaps.append(now - last)
            last = now
            sample.tokens += 1
    sample.latency = time.perf_counter() - start
    sample.tokens = expected  # ignore_eos + max_tokens: every request generates exactly this many tokens
    return sample


def run_level(url: str, clients: int, requests_per_client: int, stream: bool, route: Route = OURS,
              long_prompt: bool = False) -> tuple[list[Sample], float]:
    samples: list[Sample] = []
    lock = threading.Lock()

    def client(number: int) -> None:
        for k in range(requests_per_client):
            sample = one_request(url, number * 1000 + k, stream, route, long_prompt)
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return samples, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def rss_mb(pid: int) -> float:
    """RSS of a process and its children (the gunicorn master and its worker)."""
    total = 0
    for p in [pid] + children(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total / 1024


def children(pid: int) -> list[int]:
    """Every descendant: the children of each of the process's threads (vLLM starts its engine from a thread)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found + [g for c in found for g in children(c)]


def measure(name: str, url: str, pid: int, levels: list[int], per_client: int, route: Route = OURS,
            long_prompts: int = 0) -> dict:
    """``{(stream, clients): row}``; with ``long_prompts``, also ``("long", clients)``: that many streams of
    ~1k-token prompts at once."""
    results = {}
    for stream in (False, True):
        for clients in levels:
            samples, wall = run_level(url, clients, per_client, stream, route)
            tokens = sum(s.tokens for s in samples)
            gaps = [g for s in samples for g in s.gaps]
            row = {"tok_s": tokens / wall, "lat_p50": pct([s.latency for s in samples], 0.5),
                   "lat_p95": pct([s.latency for s in samples], 0.95), "rss_mb": rss_mb(pid)}
            if stream:
                ttfts = [s.ttft for s in samples if s.ttft is not None]
                row.update(ttft_p50=pct(ttfts, 0.5), ttft_p95=pct(ttfts, 0.95), itl_p50=pct(gaps, 0.5),
                           itl_p95=pct(gaps, 0.95))
            results[(stream, clients)] = row
            print(f"{name:9s} {'stream' if stream else 'plain ':6s} c={clients:<3d} " + format_row(row), flush=True)
    if long_prompts:
        run_level(url, 1, 1, True, route, long_prompt=True)  # warm: the first long prefill shapes caches
        samples, wall = run_level(url, long_prompts, 1, True, route, long_prompt=True)
        ttfts = [s.ttft for s in samples if s.ttft is not None]
        row = {"tok_s": sum(s.tokens for s in samples) / wall, "ttft_p50": pct(ttfts, 0.5),
               "ttft_p95": pct(ttfts, 0.95), "lat_p50": pct([s.latency for s in samples], 0.5),
               "lat_p95": pct([s.latency for s in samples], 0.95), "rss_mb": rss_mb(pid)}
        results[("long", long_prompts)] = row
        print(f"{name:9s} long   c={long_prompts:<3d} ttft p50 {row['ttft_p50'] * 1000:6.0f}ms "
              f"p95 {row['ttft_p95'] * 1000:6.0f}ms  rss {row['rss_mb']:6.0f}MB", flush=True)
    return results


def format_row(row: dict) -> str:
    text = f"{row['tok_s']:7.1f} tok/s  lat p50 {row['lat_p50']:6.2f}s p95 {row['lat_p95']:6.2f}s"
    if "ttft_p50" in row:
        text += (f"  ttft p50 {row['ttft_p50'] * 1000:6.0f}ms p95 {row['ttft_p95'] * 1000:6.0f}ms"
                 f"  itl p50 {row['itl_p50'] * 1000:5.0f}ms p95 {row['itl_p95'] * 1000:5.0f}ms")
    return text + f"  rss {row['rss_mb']:6.0f}MB"


def start(command: list[str], env: dict, log: Path, tree: Path = ROOT,
          ready_path: str = "/ping") -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    env = {**os.environ, **env, "SAGEMAKER_BIND_TO_PORT": str(port), "SERVER_HOST": "127.0.0.1"}
    with open(log, "wb") as handle:
        process = subprocess.Popen([c.replace("{port}", str(port)) for c in command], cwd=tree, env=env,
                                   stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    return process, url, wait_ready(url, process, ready_path=ready_path)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=40)
    except subprocess.TimeoutExpired:
        process.kill()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="1,4,16,32")
    parser.add_argument("--baseline-levels", default="1,4,16")
    parser.add_argument("--requests", type=int, default=2, help="requests per client per level")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    parser.add_argument("--backend", choices=("lean", "vllm"), default="lean",
                        help="vllm: also measure the vLLM backend (.venv-vllm) under the same load")
    parser.add_argument("--vllm-dtype", default="auto", help="option.dtype for the vLLM server (auto: fp32 on CPU)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:ENV=VALUE[,ENV=VALUE]",
                        help="also measure our server with these environment settings under the same load, in the "
                             "same run (e.g. int8-all:OPTION_INT8_SPLIT=all; TREE=/path serves another checkout's "
                             "code, e.g. before:TREE=../before); repeatable")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --variant: measure ours and each variant this many times, alternating, and "
                             "report each one's median")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also measure llama.cpp's server on the same model as a Q8_0 GGUF (make llama-cpp)")
    parser.add_argument("--long-prompts", type=int, default=0, metavar="N",
                        help="also N concurrent streams of ~1k-token prompts on every server (TTFT p50/p95)")
    parser.add_argument("--vllm-python", type=Path, default=ROOT / os.environ.get("VENV_VLLM", ".venv-vllm") / "bin"
                        / "python")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    base_levels = [int(x) for x in args.baseline_levels.split(",") if x]
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)

    variants = [("ours", {})] + [parse_variant(text) for text in args.variant]
    runs: dict[str, list[tuple[dict, float]]] = {name: [] for name, _ in variants}
    peers = [("llama.cpp", None)] if args.llama_cpp else []
    for _round in range(args.rounds if args.variant or peers else 1):
        for name, env in variants:
            runs[name].append(measure_server(name, env, levels, args.requests, out, args.long_prompts))
        if peers:
            runs.setdefault("llama.cpp", []).append(measure_llama_cpp(levels, args.requests, out, args.long_prompts))
    ours, ready_s = median_run(runs["ours"])
    base, base_ready = {}, None
    if base_levels:
        process, url, base_ready = start([sys.executable, "-m", "bench.baseline_server", str(MODEL_DIR), "{port}"],
                                         {}, out / "baseline.log")
        try:
            base = measure("baseline", url, process.pid, base_levels, 1)
        finally:
            stop(process)
    report = render(ours, base, ready_s, base_ready, levels, args.requests)
    if args.variant:
        report += render_variants(variants, {name: median_run(r) for name, r in runs.items()}, args.rounds)
    if peers:
        report += render_peer("llama.cpp", median_run(runs["ours"]), median_run(runs["llama.cpp"]), args.rounds)
    if args.backend == "vllm":
        env = {"OPTION_ROLLING_BATCH": "vllm", "OPTION_DTYPE": args.vllm_dtype}
        process, url, vllm_ready = start([str(args.vllm_python), "-m", "handler", "serve"], env, out / "vllm.log")
        print(f"vllm: start -> /ping 200 in {vllm_ready:.1f} s; idle RSS {rss_mb(process.pid):.0f} MB", flush=True)
        try:
            other = measure("vllm", url, process.pid, levels, args.requests)
        finally:
            stop(process)
        report += render_backends(ours, other, ready_s, vllm_ready, args.vllm_dtype)
    print(report)
    args.results.write_text(report)
    return 0


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:ENV=VALUE[,ENV=VALUE]`` -> ``(NAME, {ENV: VALUE})``; a value may hold commas
    (``OPTION_INT8_SPLIT=qkv,down``): a comma starts a new pair only before ``ENV=``."""
    name, _, settings = text.partition(":")
    pairs = re.split(r",(?=[A-Za-z_][A-Za-z0-9_]*=)", settings) if settings else []
    env = dict(pair.split("=", 1) for pair in pairs if "=" in pair)
    if not name or not env:
        raise SystemExit(f"--variant {text!r}: expected NAME:ENV=VALUE[,ENV=VALUE]")
    return name, env


def measure_llama_cpp(levels: list[int], per_client: int, out: Path, long_prompts: int) -> tuple[dict, float]:
    """llama.cpp's server on the same model (Q8_0) under the same load: one slot per client of the largest level,
    as many threads as cores; its results and start time (process start -> /health 200)."""
    from bench import llama_cpp

    slots = max(levels + [long_prompts])
    command = llama_cpp.server_command(MODEL_DIR, slots, 1536 if long_prompts else 256, os.cpu_count() or 1)
    process, url, ready_s, _flags = llama_cpp.start_server(start, command, out / "llama-cpp.log")
    print(f"llama.cpp: start -> /health 200 in {ready_s:.1f} s; idle RSS {rss_mb(process.pid):.0f} MB", flush=True)
    try:
        return measure("llama.cpp", url, process.pid, levels, per_client, Route("/v1/chat/completions", sse=True),
                       long_prompts), ready_s
    finally:
        stop(process)


def measure_server(name: str, env: dict[str, str], levels: list[int], per_client: int,
                   out: Path, long_prompts: int = 0) -> tuple[dict, float]:
    """One of our servers (the defaults, or a variant's settings) under the load; its results and start time. A
    variant's ``TREE`` names another checkout to serve from (its code, this venv): code before and after a change,
    measured in one run."""
    env = dict(env)
    tree = Path(env.pop("TREE", ROOT)).resolve()
    process, url, ready_s = start([sys.executable, "-m", "handler", "serve"], env, out / f"server-{name}.log", tree)
    print(f"{name}: start -> /ping 200 in {ready_s:.1f} s; idle RSS {rss_mb(process.pid):.0f} MB", flush=True)
    try:
        return measure(name, url, process.pid, levels, per_client, long_prompts=long_prompts), ready_s
    finally:
        stop(process)


def median_run(runs: list[tuple[dict, float]]) -> tuple[dict, float]:
    """Per cell, the median over rounds (each figure on its own)."""
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    cells = runs[0][0].keys()
    merged = {cell: {key: median([r[cell][key] for r, _ in runs]) for key in runs[0][0][cell]} for cell in cells}
    return merged, median([ready for _, ready in runs])


def render_variants(variants: list[tuple[str, dict]], results: dict[str, tuple[dict, float]], rounds: int) -> str:
    """Each variant's tok/s beside ours (the defaults), and the ratio, same load, same run."""
    names = [name for name, _ in variants]
    lines = ["", f"## Settings compared in the same run ({rounds} round(s), alternating; medians)", ""]
    lines += [f"- {name}: " + (", ".join(f"`{k}={v}`" for k, v in env.items()) or "the defaults")
              + f"; CPU: {cpu_label({**os.environ, **env})}" for name, env in variants]
    lines += ["", "| mode | clients | " + " | ".join(f"{n} tok/s" for n in names) + " | " +
              " | ".join(f"{n} / ours" for n in names[1:]) + " |", "|---|---|" + "---|" * (2 * len(names) - 1)]
    ours = results["ours"][0]
    for key, _row in steady(ours):
        stream, clients = key
        figures = [results[name][0][key]["tok_s"] for name in names]
        lines.append(f"| {'stream' if stream else 'plain'} | {clients} | " + " | ".join(f"{f:.1f}" for f in figures)
                     + " | " + " | ".join(f"{f / figures[0]:.2f}x" for f in figures[1:]) + " |")
    lines.append("| start (s) | — | " + " | ".join(f"{results[n][1]:.1f}" for n in names) + " | " + " | ".join(
        f"{results[n][1] / results['ours'][1]:.2f}x" for n in names[1:]) + " |")
    return "\n".join(lines) + "\n"


def steady(results: dict) -> list[tuple[tuple[bool, int], dict]]:
    """The plain and streamed levels' rows, in order (not the long-prompt level's)."""
    return sorted((key, row) for key, row in results.items() if key[0] != "long")


def render(ours: dict, base: dict, ready_s: float, base_ready: float | None, levels: list[int], per: int) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Benchmark results ({when})", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; command: "
             f"`make bench` (`python -m bench.run`), {per} requests per client per level for ours, 1 for the "
             "baseline. Chat schema on /invocations, greedy, ignore_eos, 64 new tokens, distinct prompts.",
             "", f"Start -> /ping 200: ours {ready_s:.1f} s" + (f", baseline {base_ready:.1f} s" if base_ready else ""),
             "", "| mode | clients | ours tok/s | baseline tok/s | ratio | TTFT p50/p95 (ms) | ITL p50/p95 (ms) | "
             "latency p50/p95 (s) | RSS (MB) | CPU |", "|---|---|---|---|---|---|---|---|---|---|"]
    cpu = cpu_label()
    for (stream, clients), row in steady(ours):
        b = base.get((stream, clients))
        baseline = f"{b['tok_s']:.1f}" if b else "—"
        ratio = f"{row['tok_s'] / b['tok_s']:.1f}x" if b else "—"
        ttft = f"{row['ttft_p50'] * 1e3:.0f} / {row['ttft_p95'] * 1e3:.0f}" if stream else "—"
        itl = f"{row['itl_p50'] * 1e3:.0f} / {row['itl_p95'] * 1e3:.0f}" if stream else "—"
        lines.append(f"| {'stream' if stream else 'plain'} | {clients} | {row['tok_s']:.1f} | {baseline} | {ratio} | "
                     f"{ttft} | {itl} | {row['lat_p50']:.2f} / {row['lat_p95']:.2f} | {row['rss_mb']:.0f} | {cpu} |")
    single = ours.get((False, 1), {}).get("tok_s")
    sixteen = ours.get((False, 16), {}).get("tok_s")
    if single and sixteen:
        lines += ["", f"16 clients vs our own single stream: {sixteen / single:.1f}x"]
    return "\n".join(lines) + "\n"


def render_peer(name: str, ours: tuple[dict, float], peer: tuple[dict, float], rounds: int) -> str:
    """Ours against another server on the same model, same load, same run (medians over the rounds)."""
    (mine, my_start), (theirs, their_start) = ours, peer
    lines = ["", f"## Ours vs {name} ({rounds} round(s), alternating; medians)", "",
             f"Start -> ready: ours {my_start:.1f} s (/ping 200), {name} {their_start:.1f} s (/health 200)", "",
             f"| mode | clients | ours tok/s | {name} tok/s | ours / {name} | TTFT p50/p95 ours (ms) | "
             f"TTFT p50/p95 {name} (ms) | CPU |", "|---|---|---|---|---|---|---|---|"]
    cpu = cpu_label()
    for key, row in sorted(mine.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        other = theirs.get(key)
        if other is None:
            continue
        mode, clients = key
        ttft = ("—", "—") if mode is False else tuple(
            f"{r['ttft_p50'] * 1e3:.0f} / {r['ttft_p95'] * 1e3:.0f}" for r in (row, other))
        label = {False: "plain", True: "stream", "long": "~1k-token prompts"}[mode]
        lines.append(f"| {label} | {clients} | {row['tok_s']:.1f} | {other['tok_s']:.1f} | "
                     f"{row['tok_s'] / other['tok_s']:.2f}x | {ttft[0]} | {ttft[1]} | {cpu} |")
    return "\n".join(lines) + "\n"


def render_backends(lean: dict, vllm: dict, lean_ready: float, vllm_ready: float, dtype: str) -> str:
    """The lean engine against vLLM behind the same front, same load, same run."""
    lines = ["", f"## Lean engine vs vLLM (`--backend vllm`, vLLM option.dtype={dtype})", "",
             f"Start -> /ping 200: lean {lean_ready:.1f} s, vLLM {vllm_ready:.1f} s", "",
             "| mode | clients | lean tok/s | vLLM tok/s | lean/vLLM | TTFT p50 lean / vLLM (ms) | "
             "RSS lean / vLLM (MB) | CPU |", "|---|---|---|---|---|---|---|---|"]
    cpu = cpu_label()
    for key, row in steady(lean):
        other = vllm.get(key)
        if other is None:
            continue
        stream, clients = key
        ttft = f"{row['ttft_p50'] * 1e3:.0f} / {other['ttft_p50'] * 1e3:.0f}" if stream else "—"
        lines.append(f"| {'stream' if stream else 'plain'} | {clients} | {row['tok_s']:.1f} | {other['tok_s']:.1f} | "
                     f"{row['tok_s'] / other['tok_s']:.2f}x | {ttft} | {row['rss_mb']:.0f} / {other['rss_mb']:.0f} | "
                     f"{cpu} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
