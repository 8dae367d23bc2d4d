"""Issue #16's scenarios: KV memory under long prompts, fairness to short requests, and prefix reuse.

Serves the embedded model with its defaults (int8 on CPU) from a checkout (``--repo``, default this one: run it
once more against a worktree of an older commit for the before figures) on a free loopback port, and runs:

  a) 15 short streaming chats and one ~7,000-token prompt at option.max_rolling_batch_size=16 (request timeout
     300 s, so that every request runs to its end): the worker's peak RSS and peak llm_kv_cache_allocated_bytes,
     and how many requests completed;
  b) 8 concurrent ~7,000-token prompts, and a short streaming chat sent 2 s later: how many completed, and the
     short chat's time to first token;
  c) a 4-turn conversation under a ~1,000-token system prompt (greedy, 32 tokens a turn): each turn's time to
     first token with option.enable_prefix_caching true and false (c is skipped with --no-prefix-option, for a
     checkout that predates the option).

Prints one JSON object. Loopback only; nothing else should run meanwhile (2 cores).

    python -m bench.kv_memory [--scenarios a,b,c] [--repo PATH] [--no-prefix-option]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests
from tokenizers import Tokenizer

from tests.e2e.conftest import RunningServer, free_port, stop_server, wait_for_ping

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "model_store" / "smollm2-135m-instruct"
SENTENCE = "The quick brown fox jumps over the lazy dog while the river keeps flowing past the old mill. "


def serve(repo: Path, tmp: Path, env: dict[str, str]) -> RunningServer:
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    environ = {**os.environ, "SAGEMAKER_BIND_TO_PORT": str(port), "SERVER_HOST": "127.0.0.1",
               "SAGEMAKER_MODEL_DIR": str(tmp / "none"), "OPTION_MODEL_ID": str(MODEL_DIR), **env}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "handler", "serve"], cwd=repo, env=environ, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    server = RunningServer(f"http://127.0.0.1:{port}", process, log_path)
    wait_for_ping(server.url, process, log_path, timeout=300)
    return server


def text_of(tokens: int) -> str:
    """Plain text of about ``tokens`` tokens in the embedded tokenizer."""
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    per_sentence = len(tokenizer.encode(SENTENCE, add_special_tokens=False).ids)
    return SENTENCE * (tokens // per_sentence)


class Sampler:
    """The worker's RSS and the KV bytes /metrics reports, every 0.2 s, peaks kept."""

    def __init__(self, server: RunningServer) -> None:
        self.server, self.peak_rss, self.peak_kv = server, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for child in psutil.Process(self.server.process.pid).children():
                    self.peak_rss = max(self.peak_rss, child.memory_info().rss / 2**20)
                for line in requests.get(f"{self.server.url}/metrics", timeout=5).text.splitlines():
                    if line.startswith("llm_kv_cache_allocated_bytes"):
                        self.peak_kv = max(self.peak_kv, float(line.rsplit(" ", 1)[1]) / 2**20)
            except (psutil.Error, requests.RequestException):
                pass
            self._stop.wait(0.2)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_rss_mib": round(self.peak_rss), "peak_kv_allocated_mib": round(self.peak_kv)}


def completion(url: str, prompt: str, max_tokens: int) -> dict:
    """A non-streaming completion: whether it finished, and its seconds."""
    start = time.perf_counter()
    try:
        response = requests.post(f"{url}/invocations", json={"prompt": prompt, "max_tokens": max_tokens,
                                                              "temperature": 0, "ignore_eos": True}, timeout=180)
        ok = response.status_code == 200
        status = response.status_code
    except requests.RequestException as error:
        ok, status = False, type(error).__name__
    return {"ok": ok, "status": status, "seconds": round(time.perf_counter() - start, 2)}


def stream_chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    """A streaming chat (JSON lines): its time to first token, total seconds, text, and whether it finished."""
    start = time.perf_counter()
    first, text, finished = None, "", False
    try:
        with requests.post(f"{url}/invocations", json={"messages": messages, "max_tokens": max_tokens,
                                                        "temperature": 0, "stream": True}, stream=True,
                           timeout=180) as response:
            for line in response.iter_lines():
                if not line:
                    continue
                record = json.loads(line)
                for choice in record.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and first is None:
                        first = time.perf_counter() - start
                    text += piece
                    finished = finished or choice.get("finish_reason") in ("stop", "length")
    except requests.RequestException:
        pass
    return {"ttft_s": None if first is None else round(first, 3), "seconds": round(time.perf_counter() - start, 2),
            "finished": finished, "text": text}


def scenario_a(repo: Path, tmp: Path) -> dict:
    server = serve(repo, tmp, {"OPTION_MAX_ROLLING_BATCH_SIZE": "16", "OPTION_REQUEST_TIMEOUT": "300"})
    try:
        sampler = Sampler(server)
        long = text_of(7000)
        with ThreadPoolExecutor(16) as pool:
            shorts = [pool.submit(stream_chat, server.url, [{"role": "user", "content": f"Count from 1 to {n}."}],
                                  100) for n in range(20, 35)]
            time.sleep(1.0)
            big = pool.submit(completion, server.url, long, 16)
            results = [f.result() for f in shorts]
            big_result = big.result()
        return {**sampler.stop(), "short_completed": sum(r["finished"] for r in results), "long": big_result}
    finally:
        stop_server(server)


def scenario_b(repo: Path, tmp: Path) -> dict:
    server = serve(repo, tmp, {})
    try:
        sampler = Sampler(server)
        long = text_of(7000)
        with ThreadPoolExecutor(9) as pool:
            bigs = [pool.submit(completion, server.url, f"{i}. " + long, 16) for i in range(8)]
            time.sleep(2.0)
            short = pool.submit(stream_chat, server.url, [{"role": "user", "content": "Say hello."}], 16).result()
            results = [f.result() for f in bigs]
        return {**sampler.stop(), "long_completed": sum(r["ok"] for r in results),
                "long_statuses": [r["status"] for r in results], "long_seconds": [r["seconds"] for r in results],
                "short_ttft_s": short["ttft_s"], "short_seconds": short["seconds"]}
    finally:
        stop_server(server)


def scenario_c(repo: Path, tmp: Path, caching: str) -> dict:
    server = serve(repo, tmp, {"OPTION_ENABLE_PREFIX_CACHING": caching})
    try:
        messages = [{"role": "system", "content": "You answer questions about this text. " + text_of(1000)}]
        ttfts = []
        for question in ("What animal jumps?", "Over what does it jump?", "What keeps flowing?", "Past what?"):
            messages.append({"role": "user", "content": question})
            turn = stream_chat(server.url, messages, 32)
            ttfts.append(turn["ttft_s"])
            messages.append({"role": "assistant", "content": turn["text"]})
        return {"ttft_s": ttfts}
    finally:
        stop_server(server)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios", default="a,b,c")
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--no-prefix-option", action="store_true")
    args = parser.parse_args()
    chosen = args.scenarios.split(",")
    out: dict = {"repo": str(args.repo)}
    with tempfile.TemporaryDirectory() as tmp:
        if "a" in chosen:
            out["a"] = scenario_a(args.repo, Path(tmp))
        if "b" in chosen:
            out["b"] = scenario_b(args.repo, Path(tmp))
        if "c" in chosen and not args.no_prefix_option:
            on, off = scenario_c(args.repo, Path(tmp), "true"), scenario_c(args.repo, Path(tmp), "false")
            later_on, later_off = on["ttft_s"][1:], off["ttft_s"][1:]
            out["c"] = {"caching_on": on, "caching_off": off,
                        "turns_2_4_ratio_off_over_on": [round(b / a, 1) for a, b in zip(later_on, later_off,
                                                                                       strict=True)]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
