"""Beam search throughput beside greedy decoding, in one run (issue #26).

The lean engine with the embedded model, int8 as served on CPU, decodes ``streams`` concurrent requests of
``TOKENS`` tokens each (``ignore_eos``: every answer is the full length), as greedy requests (one row each), as
greedy requests with ``n = width`` (the same rows per step as the beams, without the search), and as beam searches
of ``width`` beams. Printed per configuration: the seconds per round, the rows decoded per second (every beam or
choice counted) and the ratios of beam search to both greedy shapes: against ``n = width`` the cost of the search
itself (the selection on the engine thread and the cache copies of forking beams), against plain greedy the cost a
user pays for the better answer. Rounds alternate the three shapes (this machine's noise is large).
Run: ``python -m bench.beams``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

MODEL_DIR = Path("model_store/smollm2-135m-instruct")
TOKENS = 32
CONFIGS = [(2, 1), (4, 1), (4, 4), (8, 4)]  # (beam width, concurrent streams)
ROUNDS = 3


def main() -> None:
    from transformers import AutoTokenizer

    from bench.grammar_overhead import served_engine
    from handler.engine.types import BeamParams, GenerationRequest, StopConditions

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    engine = served_engine(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tuple(tokenizer.encode(text, add_special_tokens=False))
    stop = StopConditions(max_new_tokens=TOKENS, ignore_eos=True)

    def round_s(width: int, streams: int, shape: str) -> float:
        requests = [GenerationRequest(f"{shape}{i}", prompt, stop=stop, n=width if shape == "greedy n" else 1,
                                      beam=BeamParams(width) if shape == "beams" else None) for i in range(streams)]
        start = time.perf_counter()
        handles = [engine.submit(r) for r in requests]
        for handle in handles:
            assert all(e.error is None for e in handle)
        return time.perf_counter() - start

    print(f"beam search vs greedy, {TOKENS} tokens per answer, median of {ROUNDS} rounds (s per round; rows/s)")
    for width, streams in CONFIGS:
        times: dict[str, list[float]] = {"greedy": [], "greedy n": [], "beams": []}
        for _ in range(ROUNDS):
            for shape in times:
                times[shape].append(round_s(width, streams, shape))
        median = {shape: statistics.median(values) for shape, values in times.items()}
        rows = {"greedy": streams * TOKENS, "greedy n": streams * width * TOKENS, "beams": streams * width * TOKENS}
        cells = "  ".join(f"{shape} {median[shape]:6.2f} s {rows[shape] / median[shape]:6.1f} rows/s"
                          for shape in times)
        print(f"width {width} x {streams} streams: {cells}  beams/greedy-n {median['greedy n'] / median['beams']:.2f}"
              f"  beams/greedy {median['greedy'] / median['beams']:.2f} (speed ratios)")
    engine.stop()
    while engine.is_alive:  # let the engine thread leave its step before the interpreter exits
        time.sleep(0.05)


if __name__ == "__main__":
    main()
