"""One decode step of the embedded model, in-process: the lean model and its KV cache as served (int8, 14-bit split
activations), batch 1 after a 100-token prompt; the step's time and each int8 Linear's, with our decode kernel and
with the torch path (fbgemm), alternated in separate processes so neither warms the other.

    python -m bench.decode_step [--threads 2] [--rounds 2]

``--profile``: also torch's profiler table of the step's ops (the kernel's calls are ctypes, not listed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "model_store" / "smollm2-135m-instruct"


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

    for i in range(10):
        step(len(prompt) + i)
    count, start = 50, time.perf_counter()
    for i in range(count):
        step(len(prompt) + 10 + i)
    seconds = (time.perf_counter() - start) / count
    layer, x = model.layers[0], torch.randn(1, model.shape.hidden_size)
    linears = {"qkv": layer.qkv, "out": layer.out, "gate_up": layer.mlp.gate_up, "down": layer.mlp.down,
               "lm_head": model.lm_head}
    parts = []
    for name, linear in linears.items():
        rows = torch.randn(1, linear.in_features) if name == "down" else x
        for _ in range(20):
            linear(rows)
        start = time.perf_counter()
        for _ in range(200):
            linear(rows)
        parts.append(f"{name} {(time.perf_counter() - start) / 200 * 1e6:.0f} us")
    print(f"step {seconds * 1e3:.2f} ms ({1 / seconds:.1f} tok/s); " + ", ".join(parts), flush=True)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as result:
            for i in range(20):
                step(len(prompt) + 70 + i)
        print(result.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args.threads, args.profile)
        return 0
    for _round in range(args.rounds):
        for path in ("torch", "auto"):
            print(f"{'kernel' if path == 'auto' else 'torch ':6s} ", end="", flush=True)
            command = [sys.executable, "-m", "bench.decode_step", "--probe", "--threads", str(args.threads)]
            subprocess.run(command + (["--profile"] if args.profile else []), cwd=ROOT, check=True,
                           env={**os.environ, "LLM_INT8_KERNEL": path})
    return 0


if __name__ == "__main__":
    sys.exit(main())
