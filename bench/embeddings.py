"""Embeddings throughput (issue #27): inputs per second at batch 1 and 32, through the lean engine as served.

The embedded model, int8 as served on CPU (last-token pooling, normalised), embeds sentences of 10-20 tokens:
one input per request, one request at a time (batch 1: a client embedding a query); one request of 32 inputs
(batch 32: a client embedding documents); and 32 requests of one input sent at once (the engine batches them into
its steps). Rounds alternate the shapes; the median round is printed. Run: ``python -m bench.embeddings``.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

ROUNDS = 5
SENTENCES = [f"Sentence number {i} says something about the sea, the sky and the number {i * 7}." for i in range(32)]


def main() -> None:
    from transformers import AutoTokenizer

    from bench.grammar_overhead import MODEL_DIR, served_engine
    from handler.engine.types import EmbeddingRequest

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    engine = served_engine(tokenizer)
    inputs = [tuple(tokenizer.encode(text, add_special_tokens=True)) for text in SENTENCES]

    def one_by_one() -> None:
        for i, ids in enumerate(inputs):
            engine.embed(EmbeddingRequest(f"one{i}", (ids,))).result()

    def one_request() -> None:
        engine.embed(EmbeddingRequest("batch", tuple(inputs))).result()

    def concurrent() -> None:
        with ThreadPoolExecutor(len(inputs)) as pool:
            list(pool.map(lambda pair: engine.embed(EmbeddingRequest(f"c{pair[0]}", (pair[1],))).result(),
                          enumerate(inputs)))

    shapes = {"batch 1 (one request at a time)": one_by_one, "batch 32 (one request of 32 inputs)": one_request,
              "32 requests at once": concurrent}
    times: dict[str, list[float]] = {name: [] for name in shapes}
    try:
        for _ in range(ROUNDS):
            for name, run in shapes.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
    finally:
        engine.stop()
    tokens = sum(len(ids) for ids in inputs)
    print(f"embedded model, int8, {len(inputs)} inputs of {tokens / len(inputs):.1f} tokens on average, "
          f"median of {ROUNDS} rounds")
    base = statistics.median(times["batch 1 (one request at a time)"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:38s} {len(inputs) / median:8.1f} inputs/s  ({base / median:.2f}x batch 1)")


if __name__ == "__main__":
    main()
