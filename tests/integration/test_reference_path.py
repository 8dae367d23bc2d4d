"""The transformers path (``engine.reference``) through our Engine on tiny random checkpoints of architectures the
lean model does not implement (and, with option.rolling_batch=transformers, of families it does): greedy tokens
equal transformers' own ``generate``, for requests run together with chunked prefill, for n > 1 (forked
caches), and for beam search."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handler.engine.types import GenerationRequest, StopConditions
from tests.integration.conftest import engine_on_path
from tests.integration.test_engine_small import collect
from tests.support.tiny_checkpoints import build_tiny

# model type -> config overrides a tiny checkpoint needs (MoE: a few small experts)
FAMILIES = {
    "gemma": {"head_dim": 16},
    "stablelm": {},
    "cohere": {},
    "gpt_neox": {},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1,
                    "num_key_value_heads": 4},  # multi-head latent attention: no KV-head sharing
    "falcon": {},
    "phi": {},
    "starcoder2": {},
    "olmo": {},
    "helium": {"head_dim": 16},
    "ernie4_5": {},
    "bitnet": {},
    "exaone4": {},
    "glm4": {},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128},
}
# families the lean engine implements (auto serves them there): the transformers path when asked for by name
FORCED = {
    "qwen3": {},
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
                "logits_scaling": 4.0},
    "olmo2": {},
    "smollm3": {"no_rope_layers": [1, 0]},
    "phi3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "gemma2": {"head_dim": 16, "sliding_window": 8},
    "gemma3_text": {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
    "mistral": {"sliding_window": 8},
}
PROMPTS = [[5, 17, 300, 42, 7, 99, 1000, 23, 11, 4, 4242, 77, 3], [8, 9, 10], list(range(100, 140))]


@pytest.fixture(scope="module", params=sorted(FAMILIES) + sorted(FORCED))
def engine_and_folder(request, tmp_path_factory: pytest.TempPathFactory):
    forced = request.param in FORCED
    overrides = FORCED[request.param] if forced else FAMILIES[request.param]
    folder = build_tiny(tmp_path_factory.mktemp(request.param), request.param, **overrides)
    engine = engine_on_path(folder, "transformers" if forced else "auto", "transformers")
    yield engine, folder
    engine.stop()


def reference_tokens(folder: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    output = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                            do_sample=False)
    return output[0, len(prompt):].tolist()


def test_greedy_tokens_equal_transformers_generate_batched_and_chunked(engine_and_folder) -> None:
    engine, folder = engine_and_folder
    stop = StopConditions(max_new_tokens=8, ignore_eos=True)
    handles = [engine.submit(GenerationRequest(f"r{i}", tuple(p), stop=stop, n=1 + (i == 0)))
               for i, p in enumerate(PROMPTS)]  # submitted together: they share steps; the first forks
    results = [collect(handle) for handle in handles]
    for prompt, choices in zip(PROMPTS, results, strict=True):
        expected = reference_tokens(folder, prompt, 8)
        assert all(choice.token_ids == expected for choice in choices.values()), folder.name


def test_a_steps_decode_rows_share_one_forward_where_the_cache_allows(tmp_path: Path) -> None:
    """Full-attention caches: the decode rows of requests running together go through one forward (left-padded
    batch cache), and the tokens are still generate's. A sliding-window cache steps one sequence at a time."""
    folder = build_tiny(tmp_path / "llama", "llama")
    engine = engine_on_path(folder, "transformers", "transformers")
    try:
        runner = engine._loaded.runner
        assert runner.shares_steps
        shapes, forward = [], runner.model.forward
        runner.model.forward = lambda *args, **kwargs: (shapes.append(tuple(kwargs["input_ids"].shape)),
                                                        forward(*args, **kwargs))[1]
        stop = StopConditions(max_new_tokens=8, ignore_eos=True)
        handles = [engine.submit(GenerationRequest(f"r{i}", tuple(p), stop=stop)) for i, p in enumerate(PROMPTS)]
        results = [collect(handle) for handle in handles]
    finally:
        engine.stop()
    assert (len(PROMPTS), 1) in shapes  # every request decoding in the same forward
    for prompt, choices in zip(PROMPTS, results, strict=True):
        assert choices[0].token_ids == reference_tokens(folder, prompt, 8)
    windowed = engine_on_path(build_tiny(tmp_path / "mistral", "mistral", sliding_window=8), "transformers",
                              "transformers")
    try:
        assert not windowed._loaded.runner.shares_steps
    finally:
        windowed.stop()


def test_beam_search_on_the_transformers_path_equals_generate(tmp_path: Path) -> None:
    """Beams on the checkpoint's own transformers code: the forked caches are deep copies, and the hypotheses are
    transformers' own beam search's."""
    from transformers import AutoModelForCausalLM

    from handler.engine.types import BeamParams

    folder = build_tiny(tmp_path / "gemma", "gemma", head_dim=16)
    engine = engine_on_path(folder, "auto", "transformers")
    try:
        request = GenerationRequest("beams", tuple(PROMPTS[0]), n=2, beam=BeamParams(3),
                                    stop=StopConditions(max_new_tokens=10, ignore_eos=True))
        choices = collect(engine.submit(request))
    finally:
        engine.stop()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = model.generate(torch.tensor([PROMPTS[0]]), num_beams=3, num_return_sequences=2, max_new_tokens=10,
                              do_sample=False, eos_token_id=None)
    assert [choices[i].token_ids for i in range(2)] == expected[:, len(PROMPTS[0]):].tolist()
