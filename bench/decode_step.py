"""One decode step of the embedded model, in-process: the lean model and its KV cache as served (int8), batch 1 after
a 100-token prompt; the step's time, then where it goes (timing wrappers around each part, in a separate pass:
they add their own Python time, so the parts are read against the wrapped step's total, and the unwrapped step
is the figure to compare). Each tree is measured in its own processes, alternated, so neither warms the other.

    python -m bench.decode_step [--threads 2] [--rounds 3] [--tree PATH ...]

``--tree``: also measure another checkout's code (its handler/, this venv), e.g. the session start as a ``git
worktree``; the probe uses only what every version of the model code has. ``--profile``: torch's profiler table of
the step's ops too (the kernels' calls are ctypes, not listed). Set ``ATEN_CPU_CAPABILITY=avx2
LLM_INT8_KERNEL_ISA=avx2`` to measure the AVX2 paths on an AVX-512 machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "model_store" / "smollm2-135m-instruct"
STEPS = 200


def probe(threads: int, profile: bool) -> None:
    import torch
    from tokenizers import Tokenizer

    from handler.engine.model.decoder import DecoderModel
    from handler.engine.model.layout import build_layout
    from handler.engine.model.quantize import CALIBRATION_TEXT, calibrate, smooth_and_quantize

    torch.set_num_threads(threads)
    model = DecoderModel(MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"))
    ids = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(CALIBRATION_TEXT).ids
    smooth_and_quantize(model, calibrate(model, ids))
    cache = model.new_cache(1, 512)
    cache.ensure(1, 512)
    groups = model.shape.num_heads // model.shape.num_kv_heads
    prompt = ids[:100]
    model.forward(torch.tensor(prompt), torch.arange(len(prompt)), build_layout([], [(0, 0, len(prompt))], groups,
                                                                                model.device),
                  cache, torch.tensor([len(prompt) - 1]))

    def step(position: int) -> None:
        model.forward(torch.tensor([5]), torch.tensor([position]), build_layout([position], [], groups, model.device),
                      cache, torch.tensor([0]))

    def timed(first: int) -> list[float]:
        times = []
        for i in range(STEPS):
            start = time.perf_counter()
            step(first + i)
            times.append(time.perf_counter() - start)
        return times

    for i in range(20):
        step(len(prompt) + i)
    plain = statistics.median(timed(len(prompt) + 20))
    parts, wrapped = _breakdown(model, lambda: timed(len(prompt) + 20))
    print(f"step {plain * 1e3:.2f} ms ({1 / plain:.1f} tok/s); wrapped {wrapped * 1e3:.2f} ms: " + ", ".join(
        f"{name} {seconds * 1e3:.2f}" for name, seconds in parts.items()), flush=True)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as result:
            for i in range(20):
                step(len(prompt) + 70 + i)
        print(result.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def _breakdown(model, run) -> tuple[dict[str, float], float]:
    """Per step (median step's share), the seconds spent in each part: the int8 Linears (the norms, adds and SiLU
    they take in their call included), the head, attention and its KV writes, the q/k/v split with RoPE, SiLU times
    up, the norms run on their own, and the rest of the forward (embedding, RoPE tables, the layer loop, the layout)."""
    from handler.engine.model.kv_cache import KVCache
    from handler.engine.model.linear import Int8DynamicLinear
    from handler.engine.model.moe import GatedMLP

    totals: dict[str, float] = {}

    def timing(name: str, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    head, call = model.lm_head, Int8DynamicLinear.__call__
    # (owner, attribute, part): a class's method or an instance's attribute, wrapped while the steps run; the model's
    # attention is a method in some versions of the code, an attribute in others
    targets = [(GatedMLP, "gated", "silu*up"), (KVCache, "write_decode", "kv writes"), (model, "norm", "norms"),
               (Int8DynamicLinear, "fused", "int8 linears"), (GatedMLP, "fused", "int8 linears"),
               (type(model), "_attention", "attention"), (model, "attention", "attention")]
    targets += [(layer, "split", "split+rope") for layer in model.layers]
    found = [(owner, name, part, _own(owner, name)) for owner, name, part in targets if _own(owner, name) is not None]
    try:
        for owner, name, part, original in found:
            setattr(owner, name, timing(part, original))
        Int8DynamicLinear.__call__ = lambda self, x: timing("head" if self is head else "int8 linears", call)(self, x)
        steps = run()
    finally:
        Int8DynamicLinear.__call__ = call
        for owner, name, _part, original in found:
            setattr(owner, name, original)
    if "attention" in totals:  # (the writes are timed inside attention)
        totals["attention"] -= totals.get("kv writes", 0.0)
    scale = 1.0 / len(steps)
    parts = {name: seconds * scale for name, seconds in sorted(totals.items(), key=lambda item: -item[1])}
    wrapped = sum(steps) * scale
    parts["rest"] = wrapped - sum(parts.values())
    return parts, wrapped


def _own(owner: object, name: str) -> object | None:
    """A class's own method ``name`` (not an inherited one), or an instance's attribute; None where there is none."""
    if isinstance(owner, type):
        return owner.__dict__.get(name)
    return getattr(owner, name, None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], type=Path,
                        help="also measure this checkout's model code (repeatable)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args.threads, args.profile)
        return 0
    trees = [ROOT, *(tree.resolve() for tree in args.tree)]
    for _round in range(args.rounds):
        for tree in trees:
            print(f"{tree.name}: ", end="", flush=True)
            command = [sys.executable, str(Path(__file__).resolve()), "--probe", "--threads", str(args.threads)]
            subprocess.run(command + (["--profile"] if args.profile else []), cwd=tree, check=True,
                           env={**os.environ, "PYTHONPATH": str(tree)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
