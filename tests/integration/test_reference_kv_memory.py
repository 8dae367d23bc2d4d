"""The transformers path's KV memory (``runners.own_caches``): its caches are budgeted by option.kv_cache_memory as
the lean engine's are. What a sequence's cache holds is counted as transformers stores it (full attention,
recurrent states and a hybrid of both exactly; sliding windows bounded), and under a small budget a long prompt
beside short streams runs to the same greedy tokens as transformers' own ``generate``, every cache within what the
space reserved for it and the reservations within the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handler.engine.backend import EngineStats
from handler.engine.runners.own_caches import layer_bytes
from handler.engine.types import GenerationRequest, StopConditions
from tests.integration.conftest import engine_on_path
from tests.integration.test_engine_small import collect
from tests.integration.test_reference_path import reference_tokens
from tests.support.tiny_checkpoints import build_tiny

# gemma (not on the lean path) with 8 KV heads of 64: 2 layers x 2 x 8 x 64 x 4 bytes = 8 KiB a position
WIDE_GEMMA = {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64}
PER_POSITION = 2 * 2 * 8 * 64 * 4

LAYOUTS = {
    "gemma": {"head_dim": 16},                                      # full attention: exact
    "mistral": {"sliding_window": 8},                               # every layer windowed
    "gemma3_text": {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "falcon_h1": {},                                                # mamba states beside attention
    "mamba": {},                                                    # mamba's states alone, in cache_params
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},      # a mamba layer, then an attention layer
}


@pytest.mark.parametrize("model_type", sorted(LAYOUTS))
def test_the_counted_bytes_bound_what_the_cache_holds(tmp_path: Path, model_type: str) -> None:
    from transformers import AutoModelForCausalLM

    from handler.engine.runners.hf_runner import TransformersRunner

    folder = build_tiny(tmp_path / model_type, model_type, **LAYOUTS[model_type])
    runner = TransformersRunner(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    for length in (1, 5, 8, 9, 30):
        with torch.inference_mode():  # the cache as the runner makes and passes it (mamba's as cache_params)
            cache = runner.forward_cached(runner._new_cache(), list(range(1, length + 1)), 0)[1]
        held, counted = sum(layer_bytes(cache)), runner.space.bytes_for(length)
        assert held <= counted, (model_type, length)
        if model_type in ("gemma", "mamba", "jamba"):
            assert held == counted
        else:  # a bound, not a guess: at most one position per layer over
            assert counted - held <= sum(layer.per_position for layer in runner.space.cost.layers)


def test_a_long_prompt_beside_short_streams_stays_within_the_budget(tmp_path: Path) -> None:
    folder = build_tiny(tmp_path / "gemma", "gemma", **WIDE_GEMMA)
    budget = 160 * PER_POSITION  # 1.25 MiB: the long request's 108 positions and two of the short ones' 29
    long = GenerationRequest("long", tuple(range(100, 200)), stop=StopConditions(max_new_tokens=8, ignore_eos=True))
    shorts = [GenerationRequest(f"s{i}", (5 + i, 17, 300, 42, 7), stop=StopConditions(max_new_tokens=24,
                                                                                      ignore_eos=True))
              for i in range(3)]
    stats: list[EngineStats] = []
    engine = engine_on_path(folder, "auto", "transformers", kv_cache_memory="1.25MiB", on_stats=stats.append)
    overdrawn: list[str] = []
    try:
        runner = engine._loaded.runner
        space, run = runner.space, runner.run
        assert space.budget == budget and space.bytes_per_token == PER_POSITION

        def checked(plan):
            output = run(plan)
            for sequence, cache in space.caches.items():  # each cache within its reservation, all within budget
                if sum(layer_bytes(cache)) > space.reserved[sequence]:
                    overdrawn.append(sequence.request.request.request_id)
            if space.num_bytes > budget:
                overdrawn.append("budget")
            return output

        runner.run = checked
        handles = [engine.submit(r) for r in [shorts[0], long, *shorts[1:]]]
        results = {handle.request.request_id: collect(handle)[0].token_ids for handle in handles}
    finally:
        engine.stop()
    assert not overdrawn
    assert max(s.kv_cache_allocated_bytes for s in stats) > budget - 29 * PER_POSITION  # the budget was what bound
    assert all(s.kv_cache_allocated_bytes <= s.kv_cache_budget_bytes == budget for s in stats)
    for request in [long, *shorts]:
        assert results[request.request_id] == reference_tokens(folder, list(request.prompt_ids),
                                                               request.stop.max_new_tokens), request.request_id


def test_the_default_budget_is_logged_and_holds_the_context(tmp_path: Path, caplog) -> None:
    folder = build_tiny(tmp_path / "gemma", "gemma", **WIDE_GEMMA)
    with caplog.at_level("INFO", logger="handler.engine.lean.kv_budget"):
        engine = engine_on_path(folder, "auto", "transformers")
    try:
        space = engine._loaded.runner.space
    finally:
        engine.stop()
    # max_running (4) sequences of the context (128 positions) at most, as on the lean path
    assert 128 * PER_POSITION <= space.budget <= 4 * 128 * PER_POSITION
    assert any(r.getMessage().startswith("KV cache budget ") for r in caplog.records)
