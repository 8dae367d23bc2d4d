"""Per-token cost of constrained decoding with llguidance and xgrammar on this machine (issue #5's choice).

For a JSON schema and a valid answer to it, each library compiles the grammar, then for every token of the answer
computes the next-token mask (a packed bitmask, the same layout in both) and accepts the token: the work a library
adds per step to a constrained row. Applying the masks to the logits is our sampler's code, the same for both,
timed once for 16 rows. Then the engine itself (the embedded model, int8 as served on CPU) decodes 16 concurrent
requests of 64 tokens each, unconstrained and all constrained by a grammar, and the aggregate throughputs are
compared. Run: ``python -m bench.grammar_overhead`` (xgrammar is optional: it is not a dependency).
"""

from __future__ import annotations

import ctypes
import json
import statistics
import time
from pathlib import Path

import torch

from handler.engine.core.sampler import RowState
from handler.engine.types import SamplingParams

MODEL_DIR = Path("model_store/smollm2-135m-instruct")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
                     "tags": ["math", "poetry", "engines"], "address": {"city": "London", "zip": "W1"}})


def run_llguidance(tokenizer, ids: list[int], vocab: int) -> tuple[float, float, list[float]]:
    """Per token: the next-token mask into a packed int32 bitmask, then accepting the token."""
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compile_s = time.perf_counter() - start
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    per_token = []
    for token in ids:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(bitmask[0].data_ptr(), bitmask.shape[1] * 4)
        assert matcher.consume_token(token), matcher.get_error()
        per_token.append(time.perf_counter() - start)
    assert matcher.is_accepting()
    return tokenizer_s, compile_s, per_token


def run_xgrammar(tokenizer, ids: list[int], vocab: int) -> tuple[float, float, list[float]]:
    """The same two steps with xgrammar (same bitmask layout)."""
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    per_token = []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        assert matcher.accept_token(token)
        per_token.append(time.perf_counter() - start)
    return tokenizer_s, compile_s, per_token


def mask_application_us(vocab: int, rows: int = 16, repeats: int = 20) -> float:
    """Our sampler's step from packed masks to masked logits, for ``rows`` rows (the same for either library)."""
    from handler.engine.core.sampler import _apply_grammars

    class Filled:
        """Stands in for a matcher whose mask allows every other token."""

        def unsafe_compute_mask_ptr(self, pointer: int, num_bytes: int) -> None:
            ctypes.memset(pointer, 0x55, num_bytes)

    rows_state = [RowState(SamplingParams(), [], [], None, 0, Filled()) for _ in range(rows)]
    logits = torch.randn(rows, vocab)
    start = time.perf_counter()
    for _ in range(repeats):
        _apply_grammars(logits, rows_state)
    return (time.perf_counter() - start) / repeats * 1e6


def served_engine(tokenizer):
    """The lean engine over the embedded model as served on CPU (int8, 32 slots, a 512-token context), started
    and ready; the caller stops it."""
    from handler.engine.backend import EngineLimits
    from handler.engine.lean.engine import Engine, wait_until_ready
    from handler.engine.lean.load import load
    from handler.engine.lean.options import LoadOptions
    from handler.process.heap import keep_freed_memory

    torch.set_num_threads(2)
    keep_freed_memory()  # as the server does: per-step temporaries reuse heap blocks instead of fresh mmaps
    options = LoadOptions(MODEL_DIR, "float32", True, "cpu", max_running=32, max_model_len=512)
    loaded = load(options, lambda: tokenizer)[0]
    engine = Engine(lambda: loaded, EngineLimits(max_running=32, max_model_len=512, max_step_tokens=512))
    engine.start()
    wait_until_ready(engine, timeout=300)
    return engine


def engine_throughput(tokenizer, num_requests: int = 16, num_tokens: int = 64) -> None:
    """Aggregate tokens/s of the real engine, free against constrained (same prompts, same lengths)."""
    from handler.engine.types import GenerationRequest, GrammarSpec, StopConditions

    engine = served_engine(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person."}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tuple(tokenizer.encode(text, add_special_tokens=False))
    grammar = GrammarSpec("lark", 'start: /[A-Za-z ,.]+/', "bench")
    for name, spec in (("free", None), ("constrained", grammar)) * 2:  # alternated: this machine's noise is large
        requests = [GenerationRequest(f"{name}{i}", prompt, grammar=spec,
                                      stop=StopConditions(max_new_tokens=num_tokens, ignore_eos=True))
                    for i in range(num_requests)]
        start = time.perf_counter()
        handles = [engine.submit(r) for r in requests]
        generated = sum(sum(e.token_id is not None for e in handle) for handle in handles)
        elapsed = time.perf_counter() - start
        print(f"engine, {num_requests} concurrent x {num_tokens} tokens, {name:<12} {generated / elapsed:7.1f} tok/s")
    engine.stop()


def main() -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    vocab = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    print(f"schema answer: {len(ids)} tokens, vocab {vocab}")
    for name, run in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            tokenizer_s, compile_s, per_token = run(tokenizer, ids, vocab)
        except ImportError:
            print(f"{name:<11} not installed")
            continue
        per_token_us = [t * 1e6 for t in per_token]
        print(f"{name:<11} tokenizer {tokenizer_s * 1e3:7.1f} ms  compile {compile_s * 1e3:7.1f} ms  "
              f"per token mean {statistics.mean(per_token_us):7.1f} us  p50 {statistics.median(per_token_us):7.1f} us  "
              f"max {max(per_token_us):8.1f} us")
    print(f"mask application in the sampler (either library), 16 rows: {mask_application_us(vocab):.0f} us a step")
    engine_throughput(tokenizer)


if __name__ == "__main__":
    main()
