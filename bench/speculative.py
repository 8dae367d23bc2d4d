"""Speculative decoding's single-stream speed (issue #27): tokens/s with and without drafts, in one run.

The lean engine with the embedded model, int8 as served on CPU, answers one request at a time, greedy, 96 new tokens
(the answers are the same tokens with and without drafts; the engine tests hold that). Two prompts: a chat question
(an answer written fresh) and a summarise-this-text request (an answer that copies phrases of its prompt, where
prompt lookup shines). Drafters: none; prompt lookup (``ngram``: n-grams of 3 to 5 tokens, 2 tokens a step, the
server's default, and 5 a step); and, as a draft model (5 a step), the embedded model's first 8 of its 30 layers with
its own final norm and head (a layer-skip draft built here: this machine has no smaller model with the same
tokenizer). Printed: tokens/s (median of the rounds), the ratio to no
drafts, and the share of drafted tokens accepted. Rounds alternate the drafters. Run: ``python -m bench.speculative``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

MODEL_DIR = Path("model_store/smollm2-135m-instruct")
TOKENS = 96
ROUNDS = 5
DRAFT_LAYERS = 8
# the text to summarise: the opening of the README as it stood when the figures in docs/configuration.md were
# measured, kept here so that a README edit does not change the benchmark's prompt
ARTICLE = (Path(__file__).resolve().parent / "speculative_article.txt").read_text()
PROMPTS = {
    "chat": "Write a short story about a lighthouse keeper.",
    "summarise": f"Summarise this text in a few sentences, using its own words:\n\n{ARTICLE}",
}


def layer_skip_draft(folder: Path) -> Path:
    """The embedded model's first ``DRAFT_LAYERS`` layers, its final norm and its head, as a checkpoint folder."""
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((MODEL_DIR / "config.json").read_text())
    config["num_hidden_layers"] = DRAFT_LAYERS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    state = load_file(MODEL_DIR / "model.safetensors")
    kept = {name: tensor for name, tensor in state.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < DRAFT_LAYERS}
    save_file(kept, folder / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (MODEL_DIR / name).is_file():
            shutil.copy(MODEL_DIR / name, folder / name)
    return folder


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from handler.engine.backend import EngineLimits
    from handler.engine.lean.engine import Engine, wait_until_ready
    from handler.engine.lean.load import load
    from handler.engine.lean.options import LoadOptions, SpeculationOptions
    from handler.engine.types import GenerationRequest, StopConditions
    from handler.process.heap import keep_freed_memory

    torch.set_num_threads(2)
    keep_freed_memory()
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    draft = layer_skip_draft(Path(tempfile.mkdtemp()) / "draft")
    drafters = {"none": None, "ngram (default, 2)": SpeculationOptions("ngram", 2, 3, 5),
                "ngram, 5 a step": SpeculationOptions("ngram", 5, 3, 5),
                f"draft ({DRAFT_LAYERS} layers)": SpeculationOptions(str(draft), 5)}
    engines = {}
    for name, speculation in drafters.items():
        options = LoadOptions(MODEL_DIR, "float32", True, "cpu", max_running=32, max_model_len=2048,
                              speculation=speculation)
        loaded = load(options, lambda: tokenizer)[0]
        engines[name] = Engine(lambda loaded=loaded: loaded,
                               EngineLimits(max_running=32, max_model_len=2048, max_step_tokens=512))
        engines[name].start()
        wait_until_ready(engines[name], timeout=300)
    prompts = {name: tuple(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False), add_special_tokens=False))
        for name, text in PROMPTS.items()}
    stop = StopConditions(max_new_tokens=TOKENS, ignore_eos=True)
    rates: dict[tuple[str, str], list[float]] = {}
    answers: dict[tuple[str, str], list[int]] = {}
    try:
        for _ in range(ROUNDS):
            for prompt_name, prompt in prompts.items():
                for name, target in engines.items():
                    request = GenerationRequest("b", prompt, stop=stop)
                    started = time.perf_counter()
                    tokens = [e.token_id for e in target.submit(request) if e.token_id is not None]
                    rates.setdefault((prompt_name, name), []).append(len(tokens) / (time.perf_counter() - started))
                    answers[(prompt_name, name)] = tokens
        accepted = {name: (e._loop.speculator.num_accepted, e._loop.speculator.num_drafted)
                    for name, e in engines.items() if e._loop.speculator is not None}
    finally:
        for target in engines.values():
            target.stop()
    print(f"embedded model, int8, one stream, greedy, {TOKENS} tokens, median of {ROUNDS} rounds")
    for prompt_name in prompts:
        base = statistics.median(rates[(prompt_name, "none")])
        for name in engines:
            rate = statistics.median(rates[(prompt_name, name)])
            same = "same answer" if answers[(prompt_name, name)] == answers[(prompt_name, "none")] else "DIFFERENT"
            print(f"  {prompt_name:10s} {name:18s} {rate:6.1f} tok/s  {rate / base:4.2f}x  ({same})")
    for name, (ok, drafted) in accepted.items():
        print(f"  {name}: {ok} of {drafted} drafted tokens accepted ({ok / max(drafted, 1):.0%})")


if __name__ == "__main__":
    main()
