"""What int8 costs in quality, read two ways: the answers users read, and averages over text.

For fp32 and int8 with each activation block size (``linear.ACTIVATION_BLOCK`` is the default; every CPU computes the
same integers, so there is one int8 path to measure):
- the question set (``bench.questions``, 122 short questions with known answers), asked through the engine with the
  model's chat template, greedy, ``--max-tokens`` new tokens: accuracy, the share of answers identical to fp32's,
  and the share that end by ``length`` (a loop or a ramble) rather than ``stop``;
- teacher-forced over held-out texts (disjoint from the calibration text in ``handler/engine/model/quantize.py``) and
  fp32's own answers: top-1 agreement with fp32, mean KL(fp32 || scheme) per position, perplexity.

    python -m bench.quality [--blocks 32,64,128,row] [--max-tokens 100]

A block size is the number of inputs of a row that share one activation scale (``Int8DynamicLinear.block``);
``row``: one scale for the whole row. fp32's answers are computed batched (32 at once); on the machines measured
they were the same as one at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.questions import QUESTIONS, is_right
from handler.engine.backend import EngineLimits
from handler.engine.core.tokenizer import eos_token_ids, load_tokenizer
from handler.engine.lean.engine import Engine, LoadedModel, wait_until_ready
from handler.engine.model.decoder import DecoderModel
from handler.engine.model.layout import build_layout
from handler.engine.model.linear import ACTIVATION_BLOCK, describe_cpu
from handler.engine.model.quantize import CALIBRATION_TEXT, calibrate, smooth_and_quantize
from handler.engine.runners.model_runner import ModelRunner
from handler.engine.types import FinishReason, GenerationRequest, StopConditions
from handler.prompt.renderer import PromptRenderer

MODEL_DIR = Path(__file__).resolve().parent.parent / "model_store" / "smollm2-135m-instruct"
ROW = 1 << 20  # a block wider than any row: one scale per row
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
BATCH = 32


@dataclass(frozen=True)
class Answer:
    text: str
    finish: FinishReason


def block_size(name: str) -> int:
    if name == "row":
        return ROW
    if not name.isdigit() or int(name) % 4:
        raise SystemExit(f"--blocks: {name!r} is not row or a multiple of 4")
    return int(name)


def build(tokenizer, block: int | None) -> DecoderModel:
    """The embedded model in fp32 (``block`` None) or int8 with activation blocks of ``block`` inputs."""
    model = DecoderModel(MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"))
    if block is not None:
        stats = calibrate(model, tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False))
        smooth_and_quantize(model, stats, block)
    return model


def answer(model: DecoderModel, tokenizer, max_tokens: int) -> list[Answer]:
    """Every question through the engine (its scheduler, sampler and detokenizer), ``BATCH`` at a time."""
    runner = ModelRunner(model, BATCH, 1024, 1 << 30, True)
    loaded = LoadedModel(runner=runner, tokenizer=tokenizer.backend_tokenizer,
                         eos_token_ids=eos_token_ids(MODEL_DIR, tokenizer),
                         special_token_ids=frozenset(tokenizer.all_special_ids), vocab_size=model.shape.vocab_size)
    engine = Engine(lambda: loaded, EngineLimits(max_running=BATCH, max_model_len=1024, max_step_tokens=512))
    engine.start()
    wait_until_ready(engine, timeout=300)

    def one(index: int) -> Answer:
        ids = PromptRenderer(tokenizer).render_chat([{"role": "user", "content": QUESTIONS[index][0]}])
        request = GenerationRequest(request_id=f"q{index}", prompt_ids=tuple(ids),
                                    stop=StopConditions(max_new_tokens=max_tokens))
        text, finish = "", None
        for event in engine.submit(request):
            text += event.text
            finish = event.finish_reason or finish
        return Answer(text, finish)

    try:
        with ThreadPoolExecutor(BATCH) as pool:
            return list(pool.map(one, range(len(QUESTIONS))))
    finally:
        engine.stop()


def all_logits(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position: ``[len(ids), vocab]``."""
    cache = model.new_cache(1, len(ids))
    cache.ensure(1, len(ids))
    groups = model.shape.num_heads // model.shape.num_kv_heads
    layout = build_layout([], [(0, 0, len(ids))], groups, model.device)
    return model.forward(torch.tensor(ids), torch.arange(len(ids)), layout, cache, torch.arange(len(ids)))


def teacher_forced(reference: list[torch.Tensor], candidate: DecoderModel, texts: list[list[int]]) -> dict[str, float]:
    """Top-1 agreement and mean KL against the reference's log-probabilities, and the candidate's perplexity."""
    agree = positions = 0
    kl = nll = 0.0
    for ref, ids in zip(reference, texts, strict=True):
        cand = all_logits(candidate, ids).log_softmax(-1)
        agree += (ref.argmax(-1) == cand.argmax(-1)).sum().item()
        positions += len(ids)
        kl += (ref.exp() * (ref - cand)).sum().item()
        nll -= cand[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    return {"top1": agree / positions, "kl": kl / positions, "ppl": math.exp(nll / (positions - len(texts)))}


def forced_texts(tokenizer, answers: list[Answer]) -> list[list[int]]:
    """The held-out texts, and every third question with fp32's answer as a chat."""
    texts = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    for (question, *_), reply in list(zip(QUESTIONS, answers, strict=True))[::3]:
        chat = [{"role": "user", "content": question}, {"role": "assistant", "content": reply.text}]
        texts.append(tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False))
    return texts


def row(name: str, answers: list[Answer], reference: list[Answer], forced: dict[str, float] | None,
        seconds: float) -> str:
    n = len(QUESTIONS)
    right = sum(is_right(a.text, q) for a, q in zip(answers, QUESTIONS, strict=True))
    same = sum(a.text == r.text for a, r in zip(answers, reference, strict=True))
    cut = sum(a.finish == FinishReason.LENGTH for a in answers)
    forced_cells = "| — | — |" if forced is None else f"| {forced['top1']:.3f} | {forced['kl']:.4f} |"
    ppl = "" if forced is None else f"{forced['ppl']:.2f}"
    return (f"| {name} | {right}/{n} ({100 * right / n:.1f}%) | {same}/{n} ({100 * same / n:.0f}%) | "
            f"{cut}/{n} ({100 * cut / n:.1f}%) {forced_cells} {ppl} | {seconds:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default=str(ACTIVATION_BLOCK),
                        help="comma-separated activation block sizes (multiples of 4, or row)")
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--save-answers", type=Path, metavar="FILE",
                        help="also write every scheme's answers as JSON ({row name: [text, ...]}), to compare two "
                             "checkouts' answers question by question")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = load_tokenizer(MODEL_DIR)
    print(describe_cpu())
    start = time.monotonic()
    fp32 = build(tokenizer, None)
    reference = answer(fp32, tokenizer, args.max_tokens)
    texts = forced_texts(tokenizer, reference)
    ref_logprobs = [all_logits(fp32, ids).log_softmax(-1) for ids in texts]
    print(f"\n{len(QUESTIONS)} questions, greedy, up to {args.max_tokens} new tokens; teacher-forced: "
          f"{sum(map(len, texts))} positions\n")
    print("| scheme | right | identical to fp32 | ended by length | top-1 vs fp32 | KL vs fp32 | perplexity | time |")
    print("|---|---|---|---|---|---|---|---|")
    print(row("fp32", reference, reference, teacher_forced(ref_logprobs, fp32, texts), time.monotonic() - start),
          flush=True)
    saved = {"fp32": [a.text for a in reference]}
    del fp32
    for name in args.blocks.split(","):
        start = time.monotonic()
        block = block_size(name)
        model = build(tokenizer, block)
        answers = answer(model, tokenizer, args.max_tokens)
        forced = teacher_forced(ref_logprobs, model, texts)
        label = "per row" if block == ROW else f"blocks of {block}"
        label += " (default)" if block == ACTIVATION_BLOCK else ""
        print(row(f"int8, {label}", answers, reference, forced, time.monotonic() - start), flush=True)
        saved[f"int8, {label}"] = [a.text for a in answers]
    if args.save_answers:
        args.save_answers.write_text(json.dumps(saved, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
