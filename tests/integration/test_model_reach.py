"""Checkpoints the lean engine runs, proven against transformers' own forward on tiny random checkpoints (fp32,
whole and chunked prefill, and rows of different lengths batched in one step beside decode rows), greedy tokens
through the Engine for each family added to the llama block, int8 MoE layers that do not depend on the batch, and
the load of a scaled-RoPE checkpoint in a fresh process (two threads importing transformers at once used to fail
it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from handler.engine.model.decoder import DecoderModel
from handler.engine.model.layout import build_layout
from handler.engine.model.linear import Int8DynamicLinear
from handler.engine.model.moe import SparseMoE
from handler.engine.model.quantize import calibrate, smooth_and_quantize
from handler.engine.types import GenerationRequest, StopConditions
from tests.integration.conftest import engine_on_path
from tests.integration.test_engine_small import collect
from tests.integration.test_reference_path import PROMPTS, reference_tokens
from tests.support.tiny_checkpoints import build_tiny

GRANITE = {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
           "logits_scaling": 4.0}
# phi3's longrope over head_dim 16 (8 factors each), exact up to original_max_position_embeddings (256 here; the
# tests' sequences stay below it); factor 2 from max_position_embeddings / original, so attention scaling != 1
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 256,
            "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}
# 8 small experts: a few hundred tokens reach every one of them, and none is computed needlessly large
QWEN3_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# a window of 48 binds within the tests' 200-token sequences and crosses KEY_BLOCK boundaries; caps small enough
# that tanh bends the random checkpoint's scores and logits (measured: without either tanh the logits move by more
# than 2e-3, twenty times the tolerance)
GEMMA2 = {"head_dim": 16, "sliding_window": 48, "attn_logit_softcapping": 0.02, "final_logit_softcapping": 1.0}
GEMMA3 = {"head_dim": 16, "sliding_window": 48, "layer_types": ["sliding_attention", "full_attention"]}
# layer 0 sliding, layer 1 full (the config's default), RoPE its default yarn (factor 32, truncate false); a clamp
# low enough to bind on the random checkpoint's gate and up values (its default, 7, never would; measured: without
# the clamp on up alone the logits move by 3e-3, thirty times the tolerance)
GPT_OSS = {"head_dim": 16, "sliding_window": 48, "num_local_experts": 8, "num_experts_per_tok": 2,
           "intermediate_size": 32, "swiglu_limit": 0.3}

CONFIGS = {
    "llama": ("llama", {}),
    "llama-rope-llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64}}),
    "llama-rope-yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 128}}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 8}),  # every layer, windows binding in every test
    "phi3-sliding-window": ("phi3", {"sliding_window": 8}),
    "mixtral-sliding-window": ("mixtral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),  # head_dim 128 (the config's) with hidden 64 / 4 heads
    "qwen3-bias-head-dim-32": ("qwen3", {"head_dim": 32, "attention_bias": True}),
    "granite": ("granite", GRANITE),
    "granite-tied": ("granite", {**GRANITE, "tie_word_embeddings": True}),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0]}),
    "smollm3-nope-first": ("smollm3", {"no_rope_layers": [0, 1]}),
    "olmo2": ("olmo2", {}),
    "olmo2-attention-bias": ("olmo2", {"attention_bias": True}),
    "phi3": ("phi3", {}),
    "phi3-longrope": ("phi3", {"rope_scaling": LONGROPE, "original_max_position_embeddings": 256}),
    "qwen3_moe": ("qwen3_moe", QWEN3_MOE),  # every layer sparse, top-2 probabilities as they are
    # top-3 renormalised, layer 1 a dense MLP; with q/k/v biases
    "qwen3_moe-norm-topk-dense-layer": ("qwen3_moe", {**QWEN3_MOE, "num_experts_per_tok": 3, "norm_topk_prob": True,
                                                      "mlp_only_layers": [1], "attention_bias": True}),
    "qwen2_moe": ("qwen2_moe", {**QWEN3_MOE, "shared_expert_intermediate_size": 48}),  # with q/k/v biases
    "mixtral": ("mixtral", {}),  # 8 experts of intermediate 128, top-2
    "gemma2": ("gemma2", GEMMA2),  # layer 0 sliding, layer 1 full (transformers' default layer_types)
    "gemma2-tied-default-caps": ("gemma2", {"head_dim": 16, "sliding_window": 48, "tie_word_embeddings": True}),
    "gemma3_text": ("gemma3_text", GEMMA3),  # local RoPE theta 1e4 on layer 0, global 1e6 on layer 1
    "gemma3_text-rope-linear-final-cap": ("gemma3_text", {
        **GEMMA3, "layer_types": ["full_attention", "sliding_attention"], "final_logit_softcapping": 1.0,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}}),
    "gpt_oss": ("gpt_oss", GPT_OSS),  # with q/k/v/o biases
    "gpt_oss-full-first-yarn-truncate-no-bias": ("gpt_oss", {
        **GPT_OSS, "layer_types": ["full_attention", "sliding_attention"], "attention_bias": False,
        "num_experts_per_tok": 3, "swiglu_alpha": 1.2,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                            "truncate": True, "rope_theta": 10000.0}}),
}
# the families added to the llama block: each also through the Engine (loader, path choice, runner)
ENGINE_FAMILIES = ("qwen3", "granite", "smollm3", "olmo2", "phi3-longrope", "qwen3_moe", "qwen2_moe", "mixtral",
                   "gemma2", "gemma3_text", "gpt_oss")


def build(path: Path, name: str) -> Path:
    """``CONFIGS[name]``'s tiny checkpoint. gpt_oss's biases that start at zero (the experts') and its attention sinks
    (near zero) are drawn at random: zeros would hide a missing or misordered bias, and equal sinks a sink read
    for the wrong head."""
    model_type, overrides = CONFIGS[name]
    folder = build_tiny(path, model_type, **overrides)
    if model_type == "gpt_oss":
        tensors = load_file(folder / "model.safetensors")
        generator = torch.Generator().manual_seed(5)
        for key, value in tensors.items():
            if key.endswith("sinks"):
                tensors[key] = torch.rand(value.shape, generator=generator) * 4 - 2
            elif key.endswith("bias") and not value.any():
                tensors[key] = torch.rand(value.shape, generator=generator) - 0.5
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp(request.param), request.param)


def logits_in_chunks(model: DecoderModel, ids: list[int], cuts: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(ids))
    cache.ensure(1, len(ids))
    rows = []
    for start, end in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        layout = build_layout([], [(0, start, end - start)], model.shape.num_heads // model.shape.num_kv_heads,
                              model.device)
        rows.append(model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), layout, cache,
                                  torch.arange(end - start)))
    return torch.cat(rows)


def test_lean_logits_match_transformers_whole_and_chunked(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 49152, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = reference(torch.tensor([ids])).logits[0]
    ours = DecoderModel(checkpoint, dtype=torch.float32, device=torch.device("cpu"))
    for cuts in ([], [70, 130]):
        assert torch.allclose(logits_in_chunks(ours, ids, cuts), theirs, atol=1e-4), checkpoint.name


def test_lean_logits_match_transformers_batched_beside_decode_rows(checkpoint: Path) -> None:
    """Three sequences of different lengths share steps: two prefills (one cut in two), then a decode row beside
    two prefill chunks, then three decode rows; every row's logits equal transformers' on that sequence alone."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 49152, (260,), generator=torch.Generator().manual_seed(2)).tolist()
    # slot -> the sequence (prompt and the tokens decoded after it)
    seqs = [ids[:37] + ids[200:202], ids[37:150] + ids[202:203], ids[150:155] + ids[203:204]]
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = [reference(torch.tensor([seq])).logits[0] for seq in seqs]
    model = DecoderModel(checkpoint, dtype=torch.float32, device=torch.device("cpu"))
    groups = model.shape.num_heads // model.shape.num_kv_heads
    cache = model.new_cache(3, 256)
    cache.ensure(3, 256)
    # each step: decode positions (slot i = row i), prefill chunks (slot, start, length)
    steps = [([], [(0, 0, 37), (1, 0, 60)]),
             ([37], [(1, 60, 53), (2, 0, 5)]),
             ([38, 113, 5], [])]
    for decode, chunks in steps:
        rows = [(slot, pos) for slot, pos in enumerate(decode)]
        rows += [(slot, pos) for slot, start, length in chunks for pos in range(start, start + length)]
        tokens = torch.tensor([seqs[slot][pos] for slot, pos in rows])
        positions = torch.tensor([pos for _slot, pos in rows])
        layout = build_layout(decode, chunks, groups, model.device)
        ours = model.forward(tokens, positions, layout, cache, torch.arange(len(rows)))
        expected = torch.stack([theirs[slot][pos] for slot, pos in rows])
        assert torch.allclose(ours, expected, atol=1e-4), (checkpoint.name, (ours - expected).abs().max())


def test_int8_serves_every_family_close_to_dense_and_chunking_invariant(checkpoint: Path) -> None:
    """int8 (SmoothQuant folded into the pre-norms where a family has them, gemma's (1 + w) ones included; olmo2's
    post-norm block leaves q/k/v and gate/up unsmoothed) on every family: the same bits whole or chunked, and near
    the dense logits."""
    ids = torch.randint(0, 49152, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    calibration = torch.randint(0, 49152, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    dense = logits_in_chunks(DecoderModel(checkpoint, dtype=torch.float32, device=torch.device("cpu")), ids, [])
    model = DecoderModel(checkpoint, dtype=torch.float32, device=torch.device("cpu"))
    smooth_and_quantize(model, calibrate(model, calibration))
    whole = logits_in_chunks(model, ids, [])
    assert torch.equal(whole, logits_in_chunks(model, ids, [70, 130])), checkpoint.name
    assert (whole - dense).norm() / dense.norm() < 0.05, checkpoint.name


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"])
def test_an_int8_moe_layer_gives_a_row_the_same_bits_alone_or_batched(name: str, tmp_path: Path) -> None:
    """The router (and qwen2_moe's shared-expert gate) and the int8 experts compute each row on its own: every row
    alone, beside 5 others or among 47 gets the bits it gets in a prefill of 80 (a dense GEMM router did not, for
    fewer than 8 rows; a plain sigmoid on the shared-expert gate did not for some rows)."""
    model = DecoderModel(build(tmp_path / name, name), dtype=torch.float32, device=torch.device("cpu"))
    calibration = torch.randint(0, 49152, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    smooth_and_quantize(model, calibrate(model, calibration))
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.experts[0].down, Int8DynamicLinear)
    h = torch.randn(80, model.shape.hidden_size, generator=torch.Generator().manual_seed(4))
    batched = moe(h)
    for rows in [slice(row, row + 1) for row in range(80)] + [slice(2, 8), slice(33, 80)]:
        assert torch.equal(moe(h[rows]), batched[rows]), (name, rows)


@pytest.fixture(scope="module", params=ENGINE_FAMILIES)
def lean_engine_and_folder(request, tmp_path_factory: pytest.TempPathFactory):
    folder = build(tmp_path_factory.mktemp(f"engine-{request.param}"), request.param)
    engine = engine_on_path(folder, "auto", "lean")
    yield engine, folder
    engine.stop()


def test_greedy_tokens_equal_transformers_generate_through_the_engine(lean_engine_and_folder) -> None:
    """Requests submitted together (sharing steps, the longer prompt prefilled in chunks, the first forking for
    n=2) on the lean path: the tokens transformers' own ``generate`` picks."""
    engine, folder = lean_engine_and_folder
    stop = StopConditions(max_new_tokens=8, ignore_eos=True)
    handles = [engine.submit(GenerationRequest(f"r{i}", tuple(p), stop=stop, n=1 + (i == 0)))
               for i, p in enumerate(PROMPTS)]
    results = [collect(handle) for handle in handles]
    for prompt, choices in zip(PROMPTS, results, strict=True):
        expected = reference_tokens(folder, prompt, 8)
        assert all(choice.token_ids == expected for choice in choices.values()), folder.name


def test_a_scaled_rope_checkpoint_loads_in_a_fresh_process(tmp_path: Path) -> None:
    model_type, overrides = CONFIGS["llama-rope-llama3"]
    folder = build_tiny(tmp_path / "llama3", model_type, **overrides)
    script = (
        "from pathlib import Path\n"
        "from handler.engine.core.tokenizer import load_tokenizer\n"
        "from handler.engine.lean.load import load\n"
        "from handler.engine.lean.options import LoadOptions\n"
        f"folder = Path({str(folder)!r})\n"
        "loaded, _ = load(LoadOptions(folder, 'float32', False, 'cpu', max_running=2, max_model_len=256),\n"
        "                 lambda: load_tokenizer(folder))\n"
        "print('loaded', loaded.vocab_size)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "loaded 49152" in done.stdout, done.stderr[-2000:]
