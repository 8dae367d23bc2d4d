"""Long prompts on our server and llama.cpp's, in one run: time to first token (TTFT) and prompt tokens/s at about
1k, 2k, 4k and 8k prompt tokens (one request at a time, ``max_tokens: 1``, best of ``--rounds``), then eight ~7k-token
prompts at once with ``option.request_timeout=300`` and a short chat sent while they prefill (how many of the eight
are answered within 300 s, and the short chat's TTFT). Writes a markdown report (the CPU named in every table) and a
PNG of TTFT against prompt length.

    python -m bench.long_prompts [--llama-cpp] [--variant NAME:ENV=VALUE[,ENV=VALUE]] [--lengths 1024,2048,4096,8000]

``--variant`` as in ``bench.run`` (``before:TREE=/path`` serves another checkout's code; ``avx2:ATEN_CPU_CAPABILITY=
avx2,LLM_INT8_KERNEL_ISA=avx2`` holds ours to AVX2). llama.cpp serves the same model as a Q8_0 GGUF with as many
threads as there are cores (``bench.llama_cpp``, built by ``make llama-cpp``). Every prompt is distinct from its first
line, so no prefix cache serves it; the embedded model's context is 8,192 tokens, so the longest point is 8,000
(rendered prompt and answer fit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from bench.machine import cpu_label
from bench.plot import line_plot
from bench.run import MODEL_DIR, OURS, ROOT, TOPICS, Route, parse_variant, start, stop, stream_chunks

LLAMA_ROUTE = Route("/v1/chat/completions", sse=True)
DEADLINE_S = 300
CROWD, CROWD_TOKENS, CROWD_NEW_TOKENS = 8, 7000, 16
SHORT_AFTER_S = 5.0  # the short chat is sent this long after the crowd, while every long prompt prefills
CONTEXT = 8192


@dataclass
class Server:
    """One server's figures: ``lengths`` prompt tokens -> best TTFT (s); the crowd's outcome."""

    name: str
    cpu: str
    lengths: dict[int, float] = field(default_factory=dict)
    crowd_answered: int = 0
    crowd_ttfts: list[float] = field(default_factory=list)
    short_ttft: float | None = None
    ready_s: float = 0.0


def notes(index: int, count: int) -> str:
    """``count`` lines of notes, distinct per ``index`` from the first line on."""
    moods = ["calm", "bright", "strange", "busy"]
    return "\n".join(f"Note {index}.{k}: the {TOPICS[(index + k) % len(TOPICS)]} was observed at {k * 7 % 24:02d}:"
                     f"{k * 13 % 60:02d} by observer {index * 31 + k}, who wrote that it looked {moods[k % 4]}."
                     for k in range(count))


class Prompts:
    """Chat prompts of a given rendered length in tokens, counted with the model's own tokenizer and template."""

    def __init__(self) -> None:
        from handler.engine.core.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(MODEL_DIR)

    def length(self, content: str) -> int:
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                  tokenize=False)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def of_length(self, index: int, tokens: int) -> str:
        """The longest notes prompt of at most ``tokens`` rendered tokens."""
        low, high = 1, tokens // 10
        while low < high:  # about 30 tokens a line: a bisection on the line count
            middle = (low + high + 1) // 2
            if self.length(self.content(index, middle)) <= tokens:
                low = middle
            else:
                high = middle - 1
        return self.content(index, low)

    @staticmethod
    def content(index: int, lines: int) -> str:
        return notes(index, lines) + "\nWhich observer saw the first note's subject, and when?"


def body(content: str, max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def time_to_first_token(url: str, route: Route, content: str, max_tokens: int, timeout: float) -> float | None:
    """Seconds from sending to the first streamed token; None for an error status (ours: 504 past the deadline)
    or no answer within ``timeout``."""
    begun = time.perf_counter()
    try:
        with requests.post(f"{url}{route.path}", json=body(content, max_tokens, True), timeout=timeout,
                           stream=True) as response:
            if response.status_code != 200:
                return None
            first = None
            for chunk in stream_chunks(response, route.sse):
                if "error" in chunk:
                    return None
                choices = chunk.get("choices") or [{}]
                if first is None and (choices[0].get("delta") or {}).get("content"):
                    first = time.perf_counter() - begun
            return first if time.perf_counter() - begun <= timeout else None
    except (requests.RequestException, json.JSONDecodeError):
        return None


def measure_lengths(server: Server, url: str, route: Route, prompts: Prompts, lengths: list[int],
                    rounds: int) -> None:
    """TTFT at each length, one request at a time, best of ``rounds`` (each round new prompts)."""
    for tokens in lengths:
        best = None
        for round_ in range(rounds):
            content = prompts.of_length(1000 * tokens + round_, tokens)
            ttft = time_to_first_token(url, route, content, 1, DEADLINE_S)
            if ttft is not None:
                best = ttft if best is None else min(best, ttft)
        if best is not None:
            server.lengths[tokens] = best
        shown = f"{best:.2f} s" if best is not None else "no answer"
        print(f"{server.name:12s} {tokens:5d} tokens: TTFT {shown}", flush=True)


def measure_crowd(server: Server, url: str, route: Route, prompts: Prompts) -> None:
    """Eight ~7k-token prompts at once, and a short chat ``SHORT_AFTER_S`` later: how many of the eight are answered
    within ``DEADLINE_S``, their TTFTs, the short chat's TTFT."""
    ttfts: list[float | None] = [None] * CROWD

    def one(i: int) -> None:
        ttfts[i] = time_to_first_token(url, route, prompts.of_length(500 + i, CROWD_TOKENS), CROWD_NEW_TOKENS,
                                       DEADLINE_S)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(CROWD)]
    for thread in threads:
        thread.start()
    time.sleep(SHORT_AFTER_S)
    server.short_ttft = time_to_first_token(url, route, "Write a haiku about the sea.", 16, DEADLINE_S)
    for thread in threads:
        thread.join()
    server.crowd_ttfts = sorted(t for t in ttfts if t is not None)
    server.crowd_answered = len(server.crowd_ttfts)
    print(f"{server.name:12s} {CROWD} x {CROWD_TOKENS}: {server.crowd_answered} of {CROWD} answered within "
          f"{DEADLINE_S} s; short chat TTFT {server.short_ttft or float('nan'):.2f} s", flush=True)


def run_ours(name: str, env: dict[str, str], out: Path, prompts: Prompts, lengths: list[int], rounds: int,
             crowd: bool) -> Server:
    env = {"OPTION_REQUEST_TIMEOUT": str(DEADLINE_S), **env}
    tree = Path(env.pop("TREE", ROOT)).resolve()
    process, url, ready_s = start([sys.executable, "-m", "handler", "serve"], env, out / f"long-{name}.log", tree)
    server = Server(name, cpu_label({**os.environ, **env}), ready_s=ready_s)
    try:
        measure_lengths(server, url, OURS, prompts, lengths, rounds)
        if crowd:
            measure_crowd(server, url, OURS, prompts)
    finally:
        stop(process)
    return server


def run_llama_cpp(out: Path, prompts: Prompts, lengths: list[int], rounds: int, crowd: bool) -> Server:
    from bench import llama_cpp

    threads = os.cpu_count() or 1
    command = llama_cpp.server_command(MODEL_DIR, CROWD + 1, CONTEXT, threads)
    process, url, ready_s, flags = llama_cpp.start_server(start, command, out / "long-llama-cpp.log")
    server = Server("llama.cpp", f"{cpu_label({})}; Q8_0, {threads} threads{''.join(' ' + f for f in flags)}",
                    ready_s=ready_s)
    try:
        measure_lengths(server, url, LLAMA_ROUTE, prompts, lengths, rounds)
        if crowd:
            measure_crowd(server, url, LLAMA_ROUTE, prompts)
    finally:
        stop(process)
    return server


def render(servers: list[Server], lengths: list[int], rounds: int, plot: Path, command: str) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Long prompts ({when})", "", f"Command: `{command}`. One request at a time, `max_tokens: 1`, best of "
             f"{rounds}; prompt tok/s = prompt tokens / TTFT.", "",
             "| server | CPU | " + " | ".join(f"{n} tok TTFT (s) / tok/s" for n in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for s in servers:
        cells = [f"{s.lengths[n]:.2f} / {n / s.lengths[n]:.0f}" if n in s.lengths else "—" for n in lengths]
        lines.append(f"| {s.name} | {s.cpu} | " + " | ".join(cells) + " |")
    peer = next((s for s in servers if s.name == "llama.cpp"), None)
    if peer is not None:
        lines += ["", "Prompt tok/s against llama.cpp's (above 1.0x: ours is faster):", "",
                  "| server | " + " | ".join(f"{n} tok" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for s in servers:
            if s is not peer:
                lines.append(f"| {s.name} | " + " | ".join(
                    f"{peer.lengths[n] / s.lengths[n]:.2f}x" if n in s.lengths and n in peer.lengths else "—"
                    for n in lengths) + " |")
    crowd = [s for s in servers if s.crowd_ttfts or s.short_ttft is not None]
    lines += [] if not crowd else [
              "", f"{CROWD} prompts of ~{CROWD_TOKENS} tokens at once ({CROWD_NEW_TOKENS} new tokens each, "
              f"`option.request_timeout={DEADLINE_S}` on ours, a {DEADLINE_S} s client timeout on llama.cpp), and a "
              f"short chat {SHORT_AFTER_S:g} s later:", "",
              f"| server | CPU | answered within {DEADLINE_S} s | their TTFT min / max (s) | short chat TTFT (s) |",
              "|---|---|---|---|---|"]
    for s in crowd:
        spread = f"{s.crowd_ttfts[0]:.1f} / {s.crowd_ttfts[-1]:.1f}" if s.crowd_ttfts else "—"
        short = f"{s.short_ttft:.2f}" if s.short_ttft is not None else "none"
        lines.append(f"| {s.name} | {s.cpu} | {s.crowd_answered} of {CROWD} | {spread} | {short} |")
    lines += ["", f"![TTFT against prompt length]({plot.name})", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,2048,4096,8000")
    parser.add_argument("--rounds", type=int, default=2, help="requests per length per server (the best is kept)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:ENV=VALUE[,ENV=VALUE]")
    parser.add_argument("--no-ours", action="store_true", help="measure only the variants (and llama.cpp)")
    parser.add_argument("--llama-cpp", action="store_true", help="also llama.cpp's server (make llama-cpp)")
    parser.add_argument("--no-crowd", action="store_true", help="only the lengths, not the eight ~7k-token prompts")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) >= CONTEXT:
        raise SystemExit(f"--lengths: the embedded model's context is {CONTEXT} tokens")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = Prompts()
    variants = ([] if args.no_ours else [("ours", {})]) + [parse_variant(text) for text in args.variant]
    crowd = not args.no_crowd
    servers = [run_ours(name, env, args.out, prompts, lengths, args.rounds, crowd) for name, env in variants]
    if args.llama_cpp:
        servers.append(run_llama_cpp(args.out, prompts, lengths, args.rounds, crowd))
    plot = line_plot({s.name: [(n, s.lengths[n]) for n in lengths if n in s.lengths] for s in servers},
                     args.out / "long_prompts_ttft.png", f"Time to first token against prompt length ({cpu_label({})})"
                     [:110], "prompt tokens", "TTFT (s)")
    report = render(servers, lengths, args.rounds, plot, "python -m bench.long_prompts " + " ".join(sys.argv[1:]))
    (args.out / "long_prompts.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
