"""What a family's ``config.json`` means, read as transformers' config classes read it: each family's defaults for
the keys a config may leave out (``with_family_defaults``), its RoPE settings under either name (``rope_parameters``,
``rope_type``), and per layer whether it rotates, slides or routes to experts (``rope_layers``, ``sliding_layers``,
``moe_layers``; gemma3_text's RoPE per layer type: ``layer_rope_configs``), with the MoE families' tensor names.
What the lean engine implements of them, and the refusals, are ``support``'s; ``family`` builds the layers from them.

May import: nothing of the engine (plain data from ``config.json``)."""

from __future__ import annotations

# families whose RMSNorm is x * (1 + w), embeddings scaled by sqrt(hidden), with four norms per layer and
# sliding-window layers (``sliding_layers``)
GEMMA_TYPES = ("gemma2", "gemma3_text")
# families whose sliding-window layers (``sliding_layers``) the lean model implements
SLIDING_TYPES = GEMMA_TYPES + ("gpt_oss",)
# families whose every layer attends within ``sliding_window`` when the config sets one (transformers builds their
# masks with ``create_sliding_window_causal_mask`` then): Mistral, Mixtral, Phi-3 (e.g. Phi-3-mini-4k: 2047)
WINDOWED_TYPES = ("mistral", "mixtral", "phi3")
# phi3's older names for longrope (its config class renames them)
_PHI3_ROPE_NAMES = {"su": "longrope", "yarn": "longrope"}
# per MoE family, under the layer's prefix: the router, and one expert's gate, up and down ("{e}" its index)
_QWEN_EXPERTS = ("mlp.gate.weight", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                                     "mlp.experts.{e}.down_proj.weight"))
MOE_TENSORS = {
    "qwen3_moe": _QWEN_EXPERTS,
    "qwen2_moe": _QWEN_EXPERTS,
    "mixtral": ("block_sparse_moe.gate.weight", ("block_sparse_moe.experts.{e}.w1.weight",
                                                 "block_sparse_moe.experts.{e}.w3.weight",
                                                 "block_sparse_moe.experts.{e}.w2.weight")),
    # one tensor per weight for all experts (no "{e}"), after the router's bias
    "gpt_oss": ("mlp.router.weight", ("mlp.router.bias", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                                      "mlp.experts.down_proj", "mlp.experts.down_proj_bias")),
}
# per family with a shared expert: its gate, up and down, and the gate of its output (``[1, hidden]``)
SHARED_EXPERT_TENSORS = {
    "qwen2_moe": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                  "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"),
}
# config defaults of transformers' config classes that differ from the ones model.py falls back to, for a
# config.json that leaves them out (save_pretrained writes them all)
_FAMILY_DEFAULTS = {
    "qwen3": {"head_dim": 128, "max_position_embeddings": 32768},
    "granite": {"embedding_multiplier": 1.0, "attention_multiplier": 1.0, "residual_multiplier": 1.0,
                "logits_scaling": 1.0},
    "smollm3": {"rope_theta": 2000000.0, "max_position_embeddings": 32768, "no_rope_layer_interval": 4},
    "olmo2": {"rms_norm_eps": 1e-5},
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
    # (the expert count is num_experts': transformers 5 writes qwen3_moe's num_experts as num_local_experts)
    "qwen3_moe": {"max_position_embeddings": 32768, "num_experts_per_tok": 8, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen2_moe": {"max_position_embeddings": 32768, "num_experts_per_tok": 4, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {"rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
                "num_experts_per_tok": 2},
    "gemma2": {"head_dim": 256, "max_position_embeddings": 8192, "tie_word_embeddings": True,
               "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0},
    "gemma3_text": {"head_dim": 256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096},
    "mistral": {"sliding_window": 4096},  # MistralConfig's default: a config.json without the key has a window
    # (its RoPE only for a config that names none, ``with_family_defaults``)
    "gpt_oss": {"head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "sliding_window": 128,
                "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rope_theta": 150000.0,
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}},
}
_GEMMA3_THETA = {"full_attention": 1000000.0, "sliding_attention": 10000.0}
_DEFAULT_NUM_EXPERTS = {"qwen3_moe": 128, "qwen2_moe": 60, "mixtral": 8, "gpt_oss": 128}


def rope_parameters(config: dict) -> dict:
    """The RoPE settings, under transformers 5's name or the older one."""
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def rope_type(config: dict) -> str:
    rope = rope_parameters(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    return _PHI3_ROPE_NAMES.get(kind, kind) if config.get("model_type") == "phi3" else kind


def original_max_positions(config: dict) -> int:
    """longrope's pretraining length: phi3's top-level field wins over the RoPE settings' (as in transformers)."""
    return (config.get("original_max_position_embeddings")
            or rope_parameters(config).get("original_max_position_embeddings")
            or with_family_defaults(config).get("max_position_embeddings", 2048))


def with_family_defaults(config: dict) -> dict:
    """The config with its family's defaults filled in where it leaves them out (``_FAMILY_DEFAULTS``). A default
    RoPE (gpt_oss's yarn) applies only where the config names none under either name, and takes its theta along."""
    defaults = dict(_FAMILY_DEFAULTS.get(config.get("model_type"), {}))
    if "rope_theta" in rope_parameters(config):  # transformers 5 keeps it there
        defaults.pop("rope_theta", None)
    rope = defaults.pop("rope_parameters", None)
    merged = {**defaults, **config}
    if rope is not None and not rope_parameters(config):
        merged.pop("rope_scaling", None)
        merged["rope_parameters"] = {**rope, "rope_theta": merged.pop("rope_theta")}
    return merged


def rope_layers(config: dict) -> list[bool]:
    """Per layer, whether it applies RoPE: every layer, but smollm3's ``no_rope_layers`` (1 = RoPE, 0 = none;
    by default every ``no_rope_layer_interval``-th layer has none, as transformers' config fills it)."""
    layers = config.get("num_hidden_layers", 0)
    if config.get("model_type") != "smollm3":
        return [True] * layers
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = with_family_defaults(config)["no_rope_layer_interval"]
        return [(i + 1) % interval != 0 for i in range(layers)]
    return [bool(flag) for flag in flags]


def sliding_layers(config: dict) -> list[bool]:
    """Per layer, whether it attends within ``sliding_window``: every layer of mistral, mixtral and phi3 when the
    config sets a window; gemma2's, gemma3_text's and gpt_oss's as ``layer_types`` says where the config has it,
    else transformers' config rule (gemma2, gpt_oss: every other layer from the first; gemma3_text: all but every
    ``sliding_window_pattern``-th). False for every layer of the other families (they are refused when a window
    would bind)."""
    layers = config.get("num_hidden_layers", 0)
    family = config.get("model_type")
    if family in WINDOWED_TYPES:  # (transformers ignores a Mistral config's layer_types)
        return [bool(with_family_defaults(config).get("sliding_window"))] * layers
    if family not in SLIDING_TYPES:
        return [False] * layers
    if (layer_types := config.get("layer_types")) is not None:
        return [kind == "sliding_attention" for kind in layer_types]
    pattern = config.get("sliding_window_pattern", 6) if family == "gemma3_text" else 2
    return [(i + 1) % pattern != 0 for i in range(layers)]


def layer_rope_configs(config: dict) -> dict[bool, dict]:
    """The config each kind of layer computes its RoPE from, keyed by ``sliding``: gemma3_text's per layer type
    settings flattened into ``rope_parameters`` (transformers 5's nested form, or the older ``rope_theta`` /
    ``rope_scaling`` for global layers and ``rope_local_base_freq`` for local ones); the config itself for both
    kinds elsewhere."""
    if config.get("model_type") != "gemma3_text":
        return {False: config, True: config}
    nested = config.get("rope_parameters") or {}
    kinds = {}
    for sliding, kind in ((False, "full_attention"), (True, "sliding_attention")):
        if kind in nested:
            rope = {"rope_type": "default", "rope_theta": _GEMMA3_THETA[kind], **(nested[kind] or {})}
        elif sliding:
            rope = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", _GEMMA3_THETA[kind])}
        else:
            scaling = config.get("rope_scaling") or {}
            rope = {"rope_type": "default", **scaling, "rope_theta": config.get("rope_theta", _GEMMA3_THETA[kind])}
        flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        kinds[sliding] = {**flat, "rope_parameters": rope}
    return kinds


def num_experts(config: dict) -> int:
    """The routed experts per MoE layer (0 for a dense family); transformers 5 writes qwen3_moe's
    ``num_experts`` as ``num_local_experts``."""
    family = config.get("model_type")
    if family not in MOE_TENSORS:
        return 0
    count = config.get("num_local_experts", config.get("num_experts"))
    return _DEFAULT_NUM_EXPERTS[family] if count is None else count


def moe_layers(config: dict) -> list[bool]:
    """Per layer, whether its MLP is the mixture of experts: every layer of mixtral and gpt_oss; qwen3_moe's and
    qwen2_moe's every ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` (their decoder layers' rule)."""
    config = with_family_defaults(config)
    layers = config.get("num_hidden_layers", 0)
    if config.get("model_type") in ("mixtral", "gpt_oss"):
        return [True] * layers
    if config.get("model_type") not in ("qwen3_moe", "qwen2_moe") or num_experts(config) == 0:
        return [False] * layers
    step, dense = config["decoder_sparse_step"], set(config["mlp_only_layers"] or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]
