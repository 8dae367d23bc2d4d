"""What the lean engine implements: configs and tensor names it must refuse, before any weight is read."""

from __future__ import annotations

import pytest

from handler.engine.model.family_config import (
    layer_rope_configs,
    moe_layers,
    num_experts,
    rope_layers,
    rope_type,
    sliding_layers,
    with_family_defaults,
)
from handler.engine.model.support import UnsupportedModel, check_lean, sliding_window, unsupported_features

LLAMA = {"model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1, "tie_word_embeddings": False}
LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
         "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
         "mlp.up_proj.weight", "mlp.down_proj.weight"]
NAMES = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {f"model.layers.0.{n}" for n in LAYER}
QK_NORMS = {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"}
QWEN3_NAMES = NAMES | QK_NORMS
OLMO2_NAMES = (NAMES - {"model.layers.0.input_layernorm.weight"}) | QK_NORMS | {
    "model.layers.0.post_feedforward_layernorm.weight"}
MLP = {f"model.layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
PHI3 = {**LLAMA, "model_type": "phi3"}
PHI3_NAMES = (NAMES - MLP - {f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv"}) | {
    "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight"}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
QWEN3_MOE = {**LLAMA, "model_type": "qwen3_moe", "num_experts": 2, "num_experts_per_tok": 1}
QWEN3_MOE_NAMES = (QWEN3_NAMES - MLP) | {"model.layers.0.mlp.gate.weight"} | {
    f"model.layers.0.mlp.experts.{e}.{n}_proj.weight" for e in range(2) for n in ("gate", "up", "down")}
SHARED = {f"model.layers.0.mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")} | {
    "model.layers.0.mlp.shared_expert_gate.weight"}
QWEN2_MOE = {**QWEN3_MOE, "model_type": "qwen2_moe"}
QWEN2_MOE_NAMES = (QWEN3_MOE_NAMES - QK_NORMS) | SHARED
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 2}
MIXTRAL_NAMES = (NAMES - MLP) | {"model.layers.0.block_sparse_moe.gate.weight"} | {
    f"model.layers.0.block_sparse_moe.experts.{e}.w{n}.weight" for e in range(2) for n in (1, 2, 3)}
GEMMA2 = {"model_type": "gemma2", "num_hidden_layers": 1, "hidden_activation": "gelu_pytorch_tanh",
          "sliding_window": 64, "layer_types": ["sliding_attention"]}  # tied embeddings: gemma's default
GEMMA2_NAMES = (NAMES - {"lm_head.weight"}) | {f"model.layers.0.{n}_feedforward_layernorm.weight"
                                               for n in ("pre", "post")}
GEMMA3 = {**GEMMA2, "model_type": "gemma3_text"}
GEMMA3_NAMES = GEMMA2_NAMES | QK_NORMS
GPT_OSS = {"model_type": "gpt_oss", "num_hidden_layers": 1, "num_local_experts": 2, "num_experts_per_tok": 1,
           "sliding_window": 64, "layer_types": ["sliding_attention"]}
GPT_OSS_NAMES = (NAMES - MLP) | {"model.layers.0.self_attn.sinks"} | {
    f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkvo"} | {f"model.layers.0.mlp.{n}" for n in (
        "router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj",
        "experts.down_proj_bias")}


@pytest.mark.parametrize("config", [
    LLAMA,
    {**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
    {**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}},
    {**LLAMA, "model_type": "mistral", "sliding_window": None},
    {**LLAMA, "model_type": "mistral", "sliding_window": 4096},  # never reached within 4096 positions
    {**LLAMA, "model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False},
    {**LLAMA, "model_type": "qwen2", "sliding_window": 64, "layer_types": ["full_attention"]},
])
def test_what_the_lean_block_computes_is_accepted(config: dict) -> None:
    assert unsupported_features(config, 4096) == []
    check_lean(config, NAMES, 4096)


@pytest.mark.parametrize(("config", "names"), [
    ({**LLAMA, "model_type": "qwen3"}, QWEN3_NAMES),
    ({**LLAMA, "model_type": "qwen3", "sliding_window": 64, "use_sliding_window": False}, QWEN3_NAMES),
    ({**LLAMA, "model_type": "granite", "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
      "residual_multiplier": 0.22, "logits_scaling": 8.0}, NAMES),
    ({**LLAMA, "model_type": "smollm3", "no_rope_layers": [0]}, NAMES),
    ({**LLAMA, "model_type": "smollm3", "sliding_window": 64, "use_sliding_window": False}, NAMES),
    ({**LLAMA, "model_type": "olmo2"}, OLMO2_NAMES),
    (PHI3, PHI3_NAMES),
    ({**PHI3, "rope_scaling": {**LONGROPE, "original_max_position_embeddings": 4096}}, PHI3_NAMES),
    ({**PHI3, "rope_scaling": {**LONGROPE, "type": "su"}, "original_max_position_embeddings": 4096}, PHI3_NAMES),
    ({**PHI3, "sliding_window": 4096}, PHI3_NAMES),  # never reached within 4096 positions
    (QWEN3_MOE, QWEN3_MOE_NAMES),
    ({**QWEN3_MOE, "num_local_experts": 2, "norm_topk_prob": True}, QWEN3_MOE_NAMES),  # transformers 5's name
    ({**QWEN3_MOE, "mlp_only_layers": [0]}, QWEN3_NAMES),  # a dense layer: the MLP's own tensors
    ({**QWEN3_MOE, "decoder_sparse_step": 2}, QWEN3_NAMES),  # layer 0 of every 2nd: dense
    ({**QWEN3_MOE, "sliding_window": 64, "use_sliding_window": False}, QWEN3_MOE_NAMES),
    (QWEN2_MOE, QWEN2_MOE_NAMES),
    ({**QWEN2_MOE, "mlp_only_layers": [0]}, NAMES),
    ({**QWEN2_MOE, "sliding_window": 0, "use_sliding_window": False, "layer_types": ["full_attention"]},
     QWEN2_MOE_NAMES),
    (MIXTRAL, MIXTRAL_NAMES),
    ({**MIXTRAL, "sliding_window": 4096, "router_jitter_noise": 0.1}, MIXTRAL_NAMES),  # jitter: training only
    (GEMMA2, GEMMA2_NAMES),  # a window shorter than max_model_len: gemma's sliding layers are implemented
    ({**GEMMA2, "layer_types": None, "hidden_activation": None}, GEMMA2_NAMES),  # transformers' defaults
    ({**GEMMA2, "tie_word_embeddings": False}, GEMMA2_NAMES | {"lm_head.weight"}),
    (GEMMA3, GEMMA3_NAMES),
    ({**GEMMA3, "attn_logit_softcapping": 50.0}, GEMMA3_NAMES),  # transformers' gemma3 does not apply it
    ({**GEMMA3, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                                    "sliding_attention": {"rope_type": "default"}}}, GEMMA3_NAMES),
    (GPT_OSS, GPT_OSS_NAMES),  # a window shorter than max_model_len: gpt_oss's sliding layers are implemented
    ({**PHI3, "sliding_window": 2047}, PHI3_NAMES),  # Phi-3-mini-4k: every layer within its window
    ({**MIXTRAL, "sliding_window": 1024}, MIXTRAL_NAMES),
    ({**GPT_OSS, "attention_bias": False}, GPT_OSS_NAMES - {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkvo"}),
    ({**GPT_OSS, "layer_types": None, "hidden_act": "gelu"}, GPT_OSS_NAMES),  # hidden_act: not read
    ({**GPT_OSS, "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "truncate": False}}, GPT_OSS_NAMES),
])
def test_the_added_families_are_accepted_with_their_own_tensors(config: dict, names: set[str]) -> None:
    check_lean(config, names, 4096)


@pytest.mark.parametrize(("config", "named"), [
    ({**LLAMA, "model_type": "deepseek_v3"}, "this model type"),
    ({**QWEN2_MOE, "sliding_window": 64, "use_sliding_window": True}, "sliding_window 64"),
    ({**PHI3, "rope_scaling": {**LONGROPE, "original_max_position_embeddings": 1024}},
     "longrope' past original_max_position_embeddings 1024 (exact only up to that many positions: set "
     "option.max_model_len to at most 1024, now 4096)"),
    ({**PHI3, "original_max_position_embeddings": 2048, "max_position_embeddings": 8192,
      "rope_scaling": {**LONGROPE, "type": "yarn"}}, "past original_max_position_embeddings 2048"),
    ({**PHI3, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear' (it runs default, "
                                                                        "longrope)"),
    ({**PHI3, "partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
    ({**QWEN3_MOE, "num_local_experts": 4}, "num_experts and num_local_experts that differ (2, 4)"),
    ({**QWEN3_MOE, "num_experts_per_tok": 3}, "num_experts_per_tok 3 of 2 experts"),
    ({**QWEN3_MOE, "sliding_window": 64, "use_sliding_window": True}, "sliding_window 64"),
    ({**QWEN3_MOE, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({**LLAMA, "model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True}, "sliding_window 64"),
    ({**LLAMA, "model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True,
      "layer_types": ["sliding_attention"]}, "option.max_model_len to at most 64"),
    ({**LLAMA, "model_type": "smollm3", "sliding_window": 64, "use_sliding_window": True,
      "layer_types": ["sliding_attention"]}, "sliding_window 64"),
    ({**LLAMA, "model_type": "smollm3", "no_rope_layers": [1, 0]}, "no_rope_layers of 2 entries for 1 layers"),
    ({**LLAMA, "model_type": "granite", "mlp_bias": True}, "mlp_bias"),
    ({**LLAMA, "model_type": "olmo2", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({**LLAMA, "model_type": "gemma"}, "this model type"),
    ({**GEMMA2, "hidden_activation": "gelu"}, "hidden_activation 'gelu' (only gelu_pytorch_tanh)"),
    ({**GEMMA3, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**GEMMA2, "layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({**GEMMA2, "layer_types": ["chunked_attention"]}, "layer_types"),
    ({**GEMMA2, "sliding_window": None}, "sliding_attention layers without a sliding_window"),
    ({**GEMMA3, "rope_parameters": {"full_attention": {"rope_type": "longrope"}}}, "rope_type 'longrope'"),
    ({**GEMMA3, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "partial_rotary_factor": 0.5},
     "partial_rotary_factor 0.5"),
    ({**LLAMA, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({**LLAMA, "rope_scaling": {"rope_type": "longrope"}}, "rope_type 'longrope'"),
    ({**LLAMA, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({**LLAMA, "mlp_bias": True}, "mlp_bias"),
    ({**LLAMA, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True}, "sliding_window 64"),
    ({**LLAMA, "model_type": "qwen2", "sliding_window": 64, "layer_types": ["sliding_attention"]}, "sliding"),
    ({**LLAMA, "quantization_config": {"quant_method": "awq"}}, "pre-quantised weights"),
    ({**GPT_OSS, "quantization_config": {"quant_method": "mxfp4"}}, "pre-quantised weights (quantization_config mx"),
    ({**GPT_OSS, "layer_types": ["chunked_attention"]}, "layer_types"),
    ({**GPT_OSS, "sliding_window": None}, "sliding_attention layers without a sliding_window"),
    ({**GPT_OSS, "num_experts_per_tok": 3}, "num_experts_per_tok 3 of 2 experts"),
    ({**GPT_OSS, "rope_parameters": {"rope_type": "longrope"}}, "rope_type 'longrope'"),
])
def test_anything_else_is_refused_naming_it(config: dict, named: str) -> None:
    with pytest.raises(UnsupportedModel) as refused:
        check_lean(config, NAMES, 4096)
    message = str(refused.value)
    assert named in message and f"model_type {config['model_type']!r}" in message and "\n" not in message


@pytest.mark.parametrize(("names", "named"), [
    (NAMES | {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"}, "q_norm"),
    (NAMES | {"model.layers.0.mlp.gate_proj.bias"}, "gate_proj.bias"),
    (NAMES | {"model.layers.0.pre_feedforward_layernorm.weight"}, "pre_feedforward_layernorm"),
    (NAMES - {"lm_head.weight"}, "without lm_head.weight"),
    (NAMES | {"model.layers.0.self_attn.q_proj.bias"}, "q/k/v biases on only some projections"),
])
def test_tensors_the_block_would_not_read_or_lacks_are_refused(names: set[str], named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        check_lean(LLAMA, names, 4096)


@pytest.mark.parametrize(("model_type", "names", "named"), [
    ("qwen3", NAMES, "without model.layers.0.self_attn.k_norm.weight"),  # a qwen3 needs its q/k norms
    ("qwen3", QWEN3_NAMES | {"model.layers.0.pre_feedforward_layernorm.weight"}, "pre_feedforward_layernorm"),
    ("olmo2", OLMO2_NAMES | {"model.layers.0.input_layernorm.weight"}, "would not read: model.layers.0.input_"),
    ("olmo2", OLMO2_NAMES - {"model.layers.0.post_feedforward_layernorm.weight"}, "without model.layers.0.post_f"),
    ("granite", QWEN3_NAMES, "would not read: model.layers.0.self_attn.k_norm"),  # q/k norms only where read
    ("smollm3", QWEN3_NAMES, "would not read: model.layers.0.self_attn.k_norm"),
])
def test_each_family_reads_its_own_tensors(model_type: str, names: set[str], named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        check_lean({**LLAMA, "model_type": model_type}, names, 4096)


@pytest.mark.parametrize(("config", "names", "named"), [
    (PHI3, NAMES, "without model.layers.0.mlp.gate_up_proj.weight, model.layers.0.self_attn.qkv_proj.weight"),
    (PHI3, PHI3_NAMES | {"model.layers.0.self_attn.qkv_proj.bias"}, "would not read: model.layers.0.self_attn.qkv"),
    (PHI3, PHI3_NAMES | {"model.layers.0.self_attn.o_proj.bias"}, "would not read: model.layers.0.self_attn.o_proj"),
    (QWEN3_MOE, QWEN3_NAMES, "without model.layers.0.mlp.experts.0.down_proj.weight"),
    (QWEN3_MOE, QWEN3_MOE_NAMES - {"model.layers.0.mlp.experts.1.up_proj.weight"}, "without model.layers.0.mlp.e"),
    (QWEN3_MOE, QWEN3_MOE_NAMES | {"model.layers.0.mlp.shared_expert.up_proj.weight"}, "would not read: model.layer"),
    ({**QWEN3_MOE, "num_experts": 1, "num_experts_per_tok": 1}, QWEN3_MOE_NAMES, "would not read: model.layers.0.m"),
    (QWEN2_MOE, QWEN2_MOE_NAMES - {"model.layers.0.mlp.shared_expert_gate.weight"}, "without model.layers.0.mlp.sh"),
    (QWEN3_MOE, QWEN2_MOE_NAMES | QK_NORMS, "would not read: model.layers.0.mlp.shared_expert"),  # qwen3_moe: none
    (MIXTRAL, MIXTRAL_NAMES - {"model.layers.0.block_sparse_moe.gate.weight"}, "without model.layers.0.block_spar"),
    (MIXTRAL, QWEN3_MOE_NAMES - QK_NORMS, "without model.layers.0.block_sparse_moe"),
    (GPT_OSS, GPT_OSS_NAMES - {"model.layers.0.self_attn.sinks"}, "without model.layers.0.self_attn.sinks"),
    (GPT_OSS, GPT_OSS_NAMES - {"model.layers.0.mlp.router.bias"}, "without model.layers.0.mlp.router.bias"),
    (GPT_OSS, (GPT_OSS_NAMES - {"model.layers.0.mlp.experts.down_proj"}) | {
        "model.layers.0.mlp.experts.down_proj_blocks"}, "would not read: model.layers.0.mlp.experts.down_proj_b"),
])
def test_the_moe_and_fused_families_read_their_own_tensors(config: dict, names: set[str], named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        check_lean(config, names, 4096)


def test_moe_layers_and_expert_counts() -> None:
    two = {"num_hidden_layers": 4}
    assert moe_layers({**two, "model_type": "mixtral"}) == [True] * 4
    assert moe_layers({**two, "model_type": "llama"}) == [False] * 4
    assert moe_layers({**two, "model_type": "qwen3_moe"}) == [True] * 4  # decoder_sparse_step 1 by default
    assert moe_layers({**two, "model_type": "qwen3_moe", "decoder_sparse_step": 2}) == [False, True, False, True]
    assert moe_layers({**two, "model_type": "qwen3_moe", "mlp_only_layers": [0, 3]}) == [False, True, True, False]
    assert moe_layers({**two, "model_type": "qwen3_moe", "num_experts": 0}) == [False] * 4
    assert moe_layers({**two, "model_type": "qwen2_moe", "decoder_sparse_step": 2}) == [False, True, False, True]
    assert num_experts({"model_type": "qwen3_moe"}) == 128 and num_experts({"model_type": "mixtral"}) == 8
    assert num_experts({"model_type": "qwen2_moe"}) == 60
    assert num_experts({"model_type": "qwen3_moe", "num_local_experts": 60}) == 60
    assert num_experts({"model_type": "llama", "num_experts": 4}) == 0
    assert moe_layers({**two, "model_type": "gpt_oss"}) == [True] * 4
    assert num_experts({"model_type": "gpt_oss"}) == 128


def test_phi3_names_longrope_su_and_yarn() -> None:
    assert rope_type({"model_type": "phi3", "rope_scaling": {"type": "su"}}) == "longrope"
    assert rope_type({"model_type": "phi3", "rope_scaling": {"rope_type": "yarn"}}) == "longrope"
    assert rope_type({"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}}) == "yarn"


def test_family_defaults_fill_what_a_config_leaves_out() -> None:
    assert with_family_defaults({"model_type": "qwen3"})["head_dim"] == 128
    assert with_family_defaults({"model_type": "olmo2"})["rms_norm_eps"] == 1e-5
    assert with_family_defaults({"model_type": "olmo2", "rms_norm_eps": 1e-6})["rms_norm_eps"] == 1e-6
    assert with_family_defaults({"model_type": "smollm3"})["rope_theta"] == 2000000.0
    assert with_family_defaults({"model_type": "mixtral"})["rope_theta"] == 1000000.0
    assert with_family_defaults({"model_type": "qwen3_moe"})["num_experts_per_tok"] == 8
    assert "rope_theta" not in with_family_defaults({"model_type": "smollm3",
                                                     "rope_parameters": {"rope_theta": 5e6}})
    assert "head_dim" not in with_family_defaults({"model_type": "llama"})
    # gpt_oss: its yarn only where the config names no RoPE, with the config's theta; either name replaces it whole
    default = with_family_defaults({"model_type": "gpt_oss", "rope_theta": 5e5})
    assert rope_type(default) == "yarn" and default["rope_parameters"]["rope_theta"] == 5e5
    assert default["rope_parameters"]["truncate"] is False and "rope_theta" not in default
    assert with_family_defaults({"model_type": "gpt_oss"})["rope_parameters"]["rope_theta"] == 150000.0
    older = with_family_defaults({"model_type": "gpt_oss", "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert "rope_parameters" not in older and rope_type(older) == "linear" and older["rope_theta"] == 150000.0
    plain = {"model_type": "gpt_oss", "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}
    assert with_family_defaults(plain)["rope_parameters"] == plain["rope_parameters"]


def test_rope_layers() -> None:
    assert rope_layers({"model_type": "llama", "num_hidden_layers": 2}) == [True, True]
    assert rope_layers({"model_type": "smollm3", "num_hidden_layers": 2, "no_rope_layers": [1, 0]}) == [True, False]
    # transformers' default: every 4th layer without RoPE
    assert rope_layers({"model_type": "smollm3", "num_hidden_layers": 8}) == [True, True, True, False] * 2


def test_tied_embeddings_need_no_head_and_qkv_biases_are_read() -> None:
    biases = {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkvo"}
    check_lean({**LLAMA, "tie_word_embeddings": True}, (NAMES - {"lm_head.weight"}) | biases, 4096)


def test_gemma_sliding_layers_and_rope_per_layer_type() -> None:
    four = {"num_hidden_layers": 4}
    assert sliding_layers({**four, "model_type": "gemma2"}) == [True, False, True, False]
    assert sliding_layers({**four, "model_type": "gemma3_text", "sliding_window_pattern": 2}) == [True, False] * 2
    assert sliding_layers({"num_hidden_layers": 7, "model_type": "gemma3_text"}) == [True] * 5 + [False, True]
    assert sliding_layers({**four, "model_type": "gemma3_text",
                           "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}) == [False] * 3 + [True]
    assert sliding_layers({**four, "model_type": "qwen2", "sliding_window": 8}) == [False] * 4  # refused instead
    assert sliding_layers({**four, "model_type": "gpt_oss"}) == [True, False, True, False]
    assert sliding_layers({**four, "model_type": "gpt_oss", "layer_types": ["full_attention"] * 4}) == [False] * 4
    nested = layer_rope_configs({"model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {"rope_theta": 5.0}}})
    assert nested[False]["rope_parameters"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    assert nested[True]["rope_parameters"] == {"rope_type": "default", "rope_theta": 5.0}
    older = layer_rope_configs({"model_type": "gemma3_text", "rope_theta": 7.0, "rope_local_base_freq": 3.0,
                                "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert older[False]["rope_parameters"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 7.0}
    assert older[True]["rope_parameters"] == {"rope_type": "default", "rope_theta": 3.0}
    gemma2 = {"model_type": "gemma2", "rope_parameters": {"rope_theta": 9.0}}
    assert layer_rope_configs(gemma2) == {False: gemma2, True: gemma2}


def test_sliding_window_in_effect() -> None:
    assert sliding_window({"model_type": "mistral", "sliding_window": 4096}) == 4096
    assert sliding_window({"model_type": "qwen2", "sliding_window": 4096}) is None  # use_sliding_window false
    assert sliding_window({"model_type": "llama"}) is None


def test_mistral_mixtral_and_phi3_slide_every_layer_when_the_config_sets_a_window() -> None:
    mistral = {**LLAMA, "model_type": "mistral", "num_hidden_layers": 3}
    assert sliding_layers({**mistral, "sliding_window": 64}) == [True] * 3
    assert sliding_layers({**mistral, "sliding_window": None}) == [False] * 3
    assert sliding_layers({k: v for k, v in mistral.items() if k != "sliding_window"}) == [True] * 3  # 4096
    # transformers ignores a Mistral config's layer_types: the window holds on every layer
    assert sliding_layers({**mistral, "sliding_window": 64, "layer_types": ["full_attention"] * 3}) == [True] * 3
    assert sliding_layers({**PHI3, "sliding_window": 2047}) == [True] * PHI3["num_hidden_layers"]
    check_lean({**LLAMA, "model_type": "mistral", "sliding_window": 64}, NAMES, 4096)  # not refused any more
