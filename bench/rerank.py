"""Rerank throughput: one query against 32 documents, pairs per second, batch 1 against batched, through the lean
engine as a cross-encoder is served (``CrossEncoderRunner``, fp32, the served step budget of 512 tokens).

The model has ms-marco MiniLM-L-6's shape (BERT, hidden 384, 6 layers, 12 heads, feed-forward 1536; random weights:
the speed is the shape's) with a small WordPiece tokenizer of its own; each document is ~100 tokens of words it
knows, the query ~10. Three ways to send the 32 pairs: one request a document, one at a time (batch 1: a client
that scores each document alone); one request of 32 documents (batched: the engine runs as many pairs a forward as
the step budget holds); 32 one-document requests at once (the engine batches them across requests). Tokenising the
pairs (``protocol.rerank.ScoringAsk``) is inside the timing, as it is in a request. Rounds alternate the shapes; the
median round is printed. Run: ``python -m bench.rerank`` (``--step-tokens N`` for another budget).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROUNDS = 5
NUM_DOCUMENTS = 32
MINILM_L6 = {"num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536}


def documents(words: list[str], count: int, length: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(words) for _ in range(length)) + "." for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-tokens", type=int, default=512, help="option.max_num_batched_tokens (default 512)")
    args = parser.parse_args()

    import torch

    from handler.engine.backend import EngineLimits
    from handler.engine.core.tokenizer import load_tokenizer
    from handler.engine.lean.engine import Engine, wait_until_ready
    from handler.engine.lean.load import load
    from handler.engine.lean.options import LoadOptions
    from handler.prompt.renderer import PromptRenderer
    from handler.protocol.rerank import ScoringAsk
    from tests.support.tiny_checkpoints import PAIR_CORPUS, build_tiny_cross_encoder

    torch.set_num_threads(2)
    folder = build_tiny_cross_encoder(Path(tempfile.mkdtemp(prefix="rerank-bench-")) / "minilm", "bert",
                                      hidden=384, max_position_embeddings=512, **MINILM_L6)
    options = LoadOptions(folder, "float32", False, "cpu", max_running=32, max_model_len=512, rolling_batch="auto")
    tokenizer = load_tokenizer(folder)
    loaded = load(options, lambda: tokenizer)[0]
    engine = Engine(lambda: loaded, EngineLimits(max_running=32, max_model_len=512, max_step_tokens=args.step_tokens))
    engine.start()
    wait_until_ready(engine, timeout=300)
    renderer = PromptRenderer(tokenizer)
    words = sorted({word.strip(".?,").lower() for line in PAIR_CORPUS for word in line.split()})
    texts = documents(words, NUM_DOCUMENTS, 80)
    query = "What is the capital of France?"

    def score(request_id: str, docs: list[str]) -> None:
        ask = ScoringAsk((query,), tuple(docs), "query", "documents")
        engine.score(ask.pairs_request(renderer, request_id, time.monotonic())).result()

    def batch_1() -> None:
        for i, text in enumerate(texts):
            score(f"one{i}", [text])

    def batched() -> None:
        score("batch", texts)

    def concurrent() -> None:
        with ThreadPoolExecutor(len(texts)) as pool:
            list(pool.map(lambda item: score(f"c{item[0]}", [item[1]]), enumerate(texts)))

    shapes = {"batch 1 (a request a document, one at a time)": batch_1,
              f"batched (one request of {NUM_DOCUMENTS} documents)": batched,
              f"{NUM_DOCUMENTS} one-document requests at once": concurrent}
    times: dict[str, list[float]] = {name: [] for name in shapes}
    try:
        for _ in range(ROUNDS):
            for name, run in shapes.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
    finally:
        engine.stop()
    pair_tokens = [len(renderer.pairs.pair(query, text)) for text in texts]
    print(f"MiniLM-L-6-shaped BERT cross-encoder, fp32, {NUM_DOCUMENTS} pairs of {statistics.mean(pair_tokens):.0f} "
          f"tokens on average, step budget {args.step_tokens} tokens, median of {ROUNDS} rounds")
    base = statistics.median(times[next(iter(shapes))])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:48s} {NUM_DOCUMENTS / median:8.1f} pairs/s  {median * 1000:7.0f} ms  "
              f"({base / median:.2f}x batch 1)")


if __name__ == "__main__":
    main()
