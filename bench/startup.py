"""Start-up of the real server (``python -m handler serve``, the embedded model, the defaults), process start ->
/ping 200, with the start's own timeline from its log: when the worker began loading (the gunicorn master and the
worker's imports before it), the load (the weights beside the tokenizer, as the ``load took`` line splits it), and
the warm-up. Variants alternate round by round, one server at a time.

Warm starts read the start cache (``make model`` fills it: the int8 model and the tokenizer class); ``--cold``
starts each with an empty cache of its own (calibration and quantisation at start, as the first start of a model
from the Hub or S3).

    python -m bench.startup [--rounds 3] [--cold] [--variant before:TREE=../before] [--llama-cpp]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import llama_cpp
from bench.run import MODEL_DIR, ROOT, start, stop

LINE_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_time(line: str) -> float | None:
    match = LINE_TIME.match(line)
    if match is None:
        return None
    stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
    return stamp.replace(tzinfo=datetime.UTC).timestamp()


def one_start(tree: Path, env: dict, log: Path) -> dict:
    """One start: seconds to /ping 200, and the timeline's marks from the log (seconds since the process began).
    ``tree`` None: llama.cpp's server on the same model (its Q8_0 GGUF, bench.run's slots), to /health 200."""
    began = time.time()
    if tree is None:
        command = llama_cpp.server_command(MODEL_DIR, 32, 256, os.cpu_count() or 1)
        process, _url, ready_s = start(command, env, log, ready_path="/health")
        stop(process)
        return {"ping": ready_s}
    process, _url, ready_s = start([sys.executable, "-m", "handler", "serve"], env, log, tree)
    stop(process)
    marks = {"ping": ready_s}
    for line in log.read_text(errors="replace").splitlines():
        stamp = log_time(line)
        if stamp is None:
            continue
        if " on the lean path" in line and "load_begins" not in marks:
            marks["load_begins"] = stamp - began
        elif "load took" in line:
            marks["loaded"] = stamp - began
            numbers = re.findall(r"([\d.]+) s", line)
            marks["weights"], marks["tokenizer"] = float(numbers[1]), float(numbers[2])
        elif "warm-up took" in line:
            marks["warm"] = float(re.findall(r"([\d.]+) s", line)[0])
    return marks


def parse_variant(text: str) -> tuple[str, Path | None, dict]:
    name, _, settings = text.partition(":")
    env = dict(item.split("=", 1) for item in settings.split(",") if item)
    return name, Path(env.pop("TREE", ROOT)).resolve(), env


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="each start with an empty start cache of its own")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:TREE=/path[,VAR=value]: another checkout (or settings) started in the same "
                             "rounds; repeatable")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="llama.cpp's server too (make llama-cpp builds it; to its /health 200)")
    args = parser.parse_args()
    variants = [("ours", ROOT, {})] + [parse_variant(v) for v in args.variant]
    if args.llama_cpp:
        if llama_cpp.server_binary() is None:
            print("no llama-server: run make llama-cpp first", file=sys.stderr)
            return 2
        llama_cpp.q8_gguf(MODEL_DIR)  # converted once, before any start is timed
        variants.append(("llama.cpp", None, {}))
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as scratch:
        for round_index in range(args.rounds):
            for name, tree, env in variants:
                run_env = dict(env)
                if args.cold:
                    run_env["LLM_INT8_CACHE"] = tempfile.mkdtemp(dir=scratch)
                marks = one_start(tree, run_env, Path(scratch) / f"{name}-{round_index}.log")
                results[name].append(marks)
                print(f"round {round_index + 1} {name}: " + "  ".join(f"{k} {v:.2f}" for k, v in marks.items()),
                      flush=True)
    print(f"\n{'cold' if args.cold else 'warm'} start, medians of {args.rounds}:")
    print("| variant | start -> /ping 200 | load begins | load (weights / tokenizer beside them) | warm-up |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        def median(key: str, runs: list[dict] = runs) -> str:
            values = [run[key] for run in runs if key in run]
            return f"{statistics.median(values):.2f} s" if values else "-"
        print(f"| {name} | {median('ping')} | {median('load_begins')} | {median('loaded')} "
              f"({median('weights')} / {median('tokenizer')}) | {median('warm')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
