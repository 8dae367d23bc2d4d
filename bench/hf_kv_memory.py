"""Issue #28 part 8: the transformers path's KV memory under one long prompt beside short streams.

Builds a tiny random gemma checkpoint (a family the lean engine does not implement: it runs on the transformers
path) made wide enough that its cache shows in RSS (8 layers, 8 KV heads of 64, fp32: 32 KiB a position), and runs
one ~3,800-token prompt beside seven short requests in one in-process engine with option.kv_cache_memory at
``--budget`` MiB. Reports, sampled after every step: the bytes the sequences' caches hold (every tensor in them),
the bytes the KV space accounts, the process's peak RSS over its RSS before the requests (``ru_maxrss``, which also
catches a step's transient copies), preemptions, and the tokens (so runs can be compared).

    python -m bench.hf_kv_memory [--budget MIB] [--long TOKENS]

One JSON object on stdout. The machine's other load changes the timings, not the bytes.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

from handler.engine.backend import EngineLimits, EngineStats
from handler.engine.core.tokenizer import load_tokenizer
from handler.engine.lean.engine import Engine, wait_until_ready
from handler.engine.lean.load import load
from handler.engine.lean.options import KVMemory, LoadOptions
from handler.engine.types import GenerationRequest, StopConditions
from tests.support.tiny_checkpoints import build_tiny

WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 4096}


def cache_bytes(cache: object) -> int:
    """Bytes of every tensor a transformers cache (or a VLM's generate state) holds."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(folder: Path, budget_mib: int, long_tokens: int) -> dict:
    options = LoadOptions(folder, "float32", False, "cpu", max_running=8, max_model_len=4096,
                          rolling_batch="auto", kv_memory=KVMemory(f"{budget_mib}MiB"))
    loaded = load(options, lambda: load_tokenizer(folder))[0]
    stats: list[EngineStats] = []
    engine = Engine(lambda: loaded, EngineLimits(max_running=8, max_model_len=4096, max_step_tokens=512),
                    on_stats=stats.append)
    engine.start()
    wait_until_ready(engine, timeout=300)
    runner = engine._loaded.runner
    peak = {"held": 0}
    step = runner.run

    def measured(plan):
        output = step(plan)
        caches = getattr(runner.space, "caches", {})
        peak["held"] = max(peak["held"], sum(cache_bytes(c) for c in caches.values()))
        return output

    runner.run = measured
    before = rss_mib()
    start = time.perf_counter()
    long = GenerationRequest("long", tuple(range(100, 100 + long_tokens)),
                             stop=StopConditions(max_new_tokens=16, ignore_eos=True))
    shorts = [GenerationRequest(f"s{i}", tuple(range(10 + i, 40 + i)),
                                stop=StopConditions(max_new_tokens=48, ignore_eos=True)) for i in range(7)]
    handles = [engine.submit(r) for r in shorts[:3] + [long] + shorts[3:]]
    tokens = {}
    for handle in handles:
        ids = [e.token_id for e in handle if e.token_id is not None]
        tokens[handle.request.request_id] = ids
    seconds = time.perf_counter() - start
    engine.stop()
    return {"budget_mib": budget_mib, "long_prompt_tokens": long_tokens,
            "completed": sum(len(v) == (16 if k == "long" else 48) for k, v in tokens.items()),
            "peak_cache_held_mib": round(peak["held"] / 2**20, 1),
            "peak_accounted_mib": round(max((s.kv_cache_allocated_bytes for s in stats), default=0) / 2**20, 1),
            "budget_reported_mib": round(max((s.kv_cache_budget_bytes for s in stats), default=0) / 2**20, 1),
            "peak_rss_over_start_mib": round(rss_mib() - before, 1),
            "preemptions": sum(s.num_preemptions for s in stats), "seconds": round(seconds, 1),
            "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=128, help="option.kv_cache_memory in MiB")
    parser.add_argument("--long", type=int, default=3800, help="the long prompt's tokens")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny(Path(tmp) / "gemma", "gemma", **WIDE)
        result = run(folder, args.budget, args.long)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
