"""Multi-LoRA throughput (issue #31): 16 streams over 4 different adapters against 16 base streams, same server,
same run.

The embedded model as served (int8 on CPU) with ``option.enable_lora=true``; 4 PEFT adapters of rank 8 on every
attention and MLP projection, built with peft (``tests/support/tiny_adapters.py``: random ``lora_B``, so each adapter
changes the answers). Each round sends 16 concurrent completions of 64 tokens (greedy, ``ignore_eos``), all on the
base model or 4 on each adapter (by the adapter header), order alternating between rounds; the median round's
aggregate tokens/s is printed with the ratio. Loopback only; nothing else should run meanwhile (2 cores).

    python -m bench.adapters
"""

from __future__ import annotations

import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROUNDS = 3
STREAMS = 16
TOKENS = 64
ADAPTERS = ["a0", "a1", "a2", "a3"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def one_round(url: str, with_adapters: bool) -> float:
    """Aggregate generated tokens per second of 16 concurrent completions."""
    def complete(index: int) -> int:
        headers = {"X-Amzn-SageMaker-Adapter-Identifier": ADAPTERS[index % 4]} if with_adapters else {}
        body = {"prompt": f"Story {index}: once upon a time", "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True}
        answer = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=600)
        answer.raise_for_status()
        return answer.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(STREAMS) as pool:
        tokens = sum(pool.map(complete, range(STREAMS)))
    return tokens / (time.perf_counter() - started)


def main() -> None:
    from handler.config import DEFAULT_MODEL_DIR
    from tests.e2e.conftest import start_server, stop_server
    from tests.support.tiny_adapters import build_adapter

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        folders = [build_adapter(DEFAULT_MODEL_DIR, root / name, TARGETS, rank=8, alpha=16, seed=i)
                   for i, name in enumerate(ADAPTERS)]
        server = start_server(root, {"OPTION_ENABLE_LORA": "true", "OPTION_REQUEST_TIMEOUT": "600"})
        try:
            for name, folder in zip(ADAPTERS, folders, strict=True):
                requests.post(f"{server.url}/adapters", json={"name": name, "src": str(folder)},
                              timeout=120).raise_for_status()
            one_round(server.url, True)  # warm both paths once
            rates: dict[bool, list[float]] = {False: [], True: []}
            for round_number in range(ROUNDS):
                for with_adapters in ((False, True) if round_number % 2 == 0 else (True, False)):
                    rates[with_adapters].append(one_round(server.url, with_adapters))
        finally:
            stop_server(server)
    base, adapted = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"{STREAMS} streams x {TOKENS} tokens, embedded model int8, median of {ROUNDS} alternated rounds:")
    print(f"  base model only               {base:7.1f} tok/s")
    print(f"  4 adapters (rank 8), 4 each   {adapted:7.1f} tok/s")
    print(f"  adapters / base: {adapted / base:.2f}x")


if __name__ == "__main__":
    main()
