"""What int8 costs in quality: the quantised model against fp32 on a fixed held-out text set.

Prints top-1 agreement (how often both pick the same next token), mean KL(fp32 || int8) per position, and
perplexity of each on the texts. The texts are disjoint from the calibration text in handler/engine/quantize.py.

    python -m bench.quality
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from handler.engine.loader import load_tokenizer
from handler.engine.model import DecoderModel, build_layout
from handler.engine.quantize import CALIBRATION_TEXT, calibrate, smooth_and_quantize

MODEL_DIR = Path(__file__).resolve().parent.parent / "model_store" / "smollm2-135m-instruct"
TEXTS = [
    "The history of the Roman Empire spans many centuries, beginning with the founding of the city and ending "
    "with the fall of Constantinople.",
    "Photosynthesis is the process by which green plants use sunlight to synthesize foods from carbon dioxide "
    "and water.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time, in a small village near the mountains, there lived an old woman who kept bees and told "
    "stories to the children.",
    "The stock market fell sharply on Monday as investors worried about rising interest rates and slowing "
    "economic growth.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital of France "
    "is Paris.<|im_end|>\n",
]


def all_logits(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position: ``[len(ids), vocab]``."""
    cache = model.new_cache(1, len(ids))
    cache.ensure(1, len(ids))
    groups = model.shape.num_heads // model.shape.num_kv_heads
    layout = build_layout([], [(0, 0, len(ids))], groups, model.device)
    return model.forward(torch.tensor(ids), torch.arange(len(ids)), layout, cache, torch.arange(len(ids)))


def compare(reference: DecoderModel, candidate: DecoderModel, texts: list[list[int]]) -> dict[str, float]:
    agree = positions = 0
    kl = nll_ref = nll_cand = 0.0
    for ids in texts:
        ref, cand = all_logits(reference, ids).log_softmax(-1), all_logits(candidate, ids).log_softmax(-1)
        agree += (ref.argmax(-1) == cand.argmax(-1)).sum().item()
        positions += len(ids)
        kl += (ref.exp() * (ref - cand)).sum().item()
        targets = torch.tensor(ids[1:])[:, None]
        nll_ref -= ref[:-1].gather(1, targets).sum().item()
        nll_cand -= cand[:-1].gather(1, targets).sum().item()
    predicted = positions - len(texts)
    return {"top1_agreement": agree / positions, "mean_kl": kl / positions,
            "ppl_fp32": math.exp(nll_ref / predicted), "ppl_int8": math.exp(nll_cand / predicted)}


def main() -> None:
    tokenizer = load_tokenizer(MODEL_DIR)
    texts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    reference = DecoderModel(MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"))
    quantised = DecoderModel(MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"))
    smooth_and_quantize(quantised, calibrate(quantised, tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)))
    result = compare(reference, quantised, texts)
    print(f"{sum(map(len, texts))} positions: top-1 agreement {result['top1_agreement']:.3f}, "
          f"mean KL {result['mean_kl']:.4f}, perplexity fp32 {result['ppl_fp32']:.2f} vs int8 {result['ppl_int8']:.2f}")


if __name__ == "__main__":
    main()
