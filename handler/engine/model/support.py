"""What the lean engine implements, checked from ``config.json`` and the tensor names before any weight is loaded.

The lean model (``model.py``) is one block: pre-norm RMSNorm (``x * w``), attention with rotary embeddings in the
``rotate_half`` layout over the whole head, optional q/k/v and o biases, a SiLU-gated MLP without biases, every
layer attending to every earlier position. The families it runs are that block with these differences:

- llama, mistral, qwen2: the block itself; mistral (and mixtral, phi3) with every layer attending within
  ``sliding_window`` when the config sets one (Mistral's default 4096 when config.json leaves the key out).
- qwen3: RMSNorm on each q and k head (``q_norm`` / ``k_norm``, before RoPE); ``head_dim`` from the config.
- granite: ``embedding_multiplier``, ``attention_multiplier`` (the attention scale), ``residual_multiplier`` (each
  sublayer's output) and ``logits_scaling`` (logits divided by it), all folded into weights at load.
- smollm3: layers without RoPE (``no_rope_layers``: 1 uses RoPE, 0 does not).
- olmo2: RMSNorm on the whole q and k projections, and post-norms (``post_attention_layernorm`` and
  ``post_feedforward_layernorm`` on each sublayer's output before the residual add) instead of pre-norms.
- phi3: q/k/v in one ``qkv_proj`` and gate/up in one ``gate_up_proj`` (no biases); RoPE ``default`` or ``longrope``
  (``su`` and ``yarn`` are phi3's old names for it), longrope only up to ``original_max_position_embeddings``
  positions: past them transformers switches every position of the sequence, earlier ones included, to the long
  factors, which no cache of earlier keys can follow.
- qwen3_moe: qwen3's attention; the MLP of each layer picked by ``mlp_only_layers`` and ``decoder_sparse_step``
  is a sparse mixture of ``num_experts`` gated MLPs, each row routed to ``num_experts_per_tok`` of them (softmax,
  top-k, renormalised over the k when ``norm_topk_prob``); no shared expert.
- qwen2_moe: qwen2's attention, qwen3_moe's MoE layers, each with a shared expert besides the routed ones (a
  gated MLP on every row, scaled by ``sigmoid(shared_expert_gate(x))``).
- mixtral: mistral's attention; every layer's MLP a sparse mixture of ``num_local_experts`` gated MLPs, top
  ``num_experts_per_tok``, always renormalised (``router_jitter_noise`` and the aux loss act only in training).
- gemma2: RMSNorm ``x * (1 + w)``; embeddings scaled by ``sqrt(hidden_size)`` (the tied LM head reads them
  unscaled); a GELU-tanh gated MLP (``hidden_activation`` ``gelu_pytorch_tanh``); four norms per layer
  (``input_layernorm``, ``post_attention_layernorm`` on the attention output before the residual add,
  ``pre_feedforward_layernorm``, ``post_feedforward_layernorm`` on the MLP output); attention scale
  ``query_pre_attn_scalar ** -0.5``; ``attn_logit_softcapping`` (``tanh(s / cap) * cap`` on the scores, before the
  mask) and ``final_logit_softcapping`` on the logits; sliding-window attention (a query at ``p`` sees keys in
  ``(p - sliding_window, p]``) on the layers ``layer_types`` marks (by default every other one, from the first).
- gemma3_text: gemma2's block with (1 + w) RMSNorm on each q and k head, no attention softcapping (transformers
  ignores ``attn_logit_softcapping`` there), the sliding layers by ``layer_types`` (by default all but every
  ``sliding_window_pattern``-th) and RoPE per layer type (``rope_parameters`` keyed by ``sliding_attention`` /
  ``full_attention``; older configs: ``rope_local_base_freq`` for local layers, ``rope_theta`` and
  ``rope_scaling`` for global ones).
- gpt_oss: the llama block with attention sinks (``self_attn.sinks``: a learned logit per query head that joins
  each softmax's denominator and weighs no value), gemma2's sliding layers (``layer_types``, by default every
  other one from the first) and RoPE as its config names it (yarn, ``truncate`` included, by default); every
  layer's MLP a sparse mixture of ``num_local_experts`` experts: router logits with a bias, top
  ``num_experts_per_tok`` logits softmaxed, experts stored stacked (gate and up columns interleaved) with biases,
  each a clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``: ``(clamp(up) + 1) * g * sigmoid(alpha * g)``,
  ``g = min(gate, limit)``). ``hidden_act`` is not read (as in transformers).

A checkpoint that needs anything else would run and answer wrongly, so it is refused instead, with the reason: the
model type, a config feature, or a tensor the lean model would not read (or lacks). What a config means where it
leaves keys out or differs per layer is ``family_config``'s; this module holds what the lean engine implements of
it, and the checks that refuse the rest.

May import: ``model.checkpoint`` (tensor names) and ``model.family_config``. Nothing else of the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from handler.engine.model.checkpoint import tensor_names
from handler.engine.model.family_config import (
    GEMMA_TYPES,
    MOE_TENSORS,
    SHARED_EXPERT_TENSORS,
    SLIDING_TYPES,
    WINDOWED_TYPES,
    layer_rope_configs,
    moe_layers,
    num_experts,
    original_max_positions,
    rope_layers,
    rope_parameters,
    rope_type,
    sliding_layers,
    with_family_defaults,
)

# model_type values whose checkpoints are this block, differing only in names read from the config
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite", "smollm3", "olmo2", "phi3", "qwen3_moe",
                    "qwen2_moe", "mixtral", "gemma2", "gemma3_text", "gpt_oss")
_GEMMA_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
# rope types whose tables transformers' rotary module computes once for every position (dynamic NTK changes
# nothing up to max_position_embeddings, which bounds our context)
LEAN_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# phi3's own: the types its config accepts (it renames su and yarn to longrope)
_FAMILY_ROPE_TYPES = {"phi3": ("default", "longrope")}
_LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                  "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_OPTIONAL_LAYER_TENSORS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                           "self_attn.o_proj.bias")
_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
_MLP_TENSORS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
# each family's layer tensors, where they differ from the llama block's (an MoE layer's MLP: _layer_tensors)
_FAMILY_LAYER_TENSORS = {
    "qwen3": _LAYER_TENSORS + _QK_NORMS,
    "qwen3_moe": _LAYER_TENSORS + _QK_NORMS,
    "olmo2": tuple(n for n in _LAYER_TENSORS if n != "input_layernorm.weight")
    + ("post_feedforward_layernorm.weight",) + _QK_NORMS,
    "phi3": ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"),
    "gemma2": _LAYER_TENSORS + _GEMMA_NORMS,
    "gemma3_text": _LAYER_TENSORS + _GEMMA_NORMS + _QK_NORMS,
    "gpt_oss": _LAYER_TENSORS + ("self_attn.sinks",),
}
_NO_OPTIONAL_TENSORS = ("phi3",)  # its projections have no biases
_GEMMA_ACTIVATION = "gelu_pytorch_tanh"


class UnsupportedModel(ValueError):
    """The lean engine does not implement this checkpoint; the message is one line naming why."""


def check_lean(config: dict, names: Iterable[str] | None, max_model_len: int) -> None:
    """Raise ``UnsupportedModel`` unless the lean engine computes exactly what transformers does for this config
    (and these tensor names, when given) up to ``max_model_len`` positions."""
    reasons = unsupported_features(config, max_model_len)
    if not reasons and names is not None:
        reasons = _tensor_problems(config, set(names))
    if reasons:
        raise UnsupportedModel(f"model_type {config.get('model_type')!r}: the lean engine does not implement "
                               + "; ".join(reasons))


def check_lean_folder(model_dir: Path, max_model_len: int) -> None:
    check_lean(json.loads((model_dir / "config.json").read_text()), tensor_names(model_dir), max_model_len)


def unsupported_features(config: dict, max_model_len: int) -> list[str]:
    """Why the lean engine cannot run this config exactly; empty when it can."""
    model_type = config.get("model_type")
    if model_type not in LEAN_MODEL_TYPES:
        return [f"this model type (it runs {', '.join(LEAN_MODEL_TYPES)})"]
    reasons = []
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        reasons.append(f"pre-quantised weights (quantization_config {method})")
    if model_type in GEMMA_TYPES:
        reasons += _gemma_problems(config)
    elif model_type != "gpt_oss" and (act := config.get("hidden_act", "silu")) != "silu":
        reasons.append(f"hidden_act {act!r} (only silu)")
    for rope_config in {id(c): c for c in layer_rope_configs(config).values()}.values():
        reasons += _rope_problems(rope_config, max_model_len)
    reasons += _moe_problems(config)
    if config.get("mlp_bias"):
        reasons.append("mlp_bias")
    if model_type == "smollm3" and len(rope_layers(config)) != config.get("num_hidden_layers", 0):
        reasons.append(f"no_rope_layers of {len(config['no_rope_layers'])} entries for "
                       f"{config.get('num_hidden_layers', 0)} layers")
    if model_type in SLIDING_TYPES:
        reasons += _layer_type_problems(config)
    elif model_type not in WINDOWED_TYPES and (window := sliding_window(config)) is not None \
            and window < max_model_len:
        reasons.append(f"sliding_window {window} (exact only up to that many positions: set "
                       f"option.max_model_len to at most {window}, now {max_model_len})")
    return reasons


def _rope_problems(config: dict, max_model_len: int) -> list[str]:
    reasons = []
    kinds = _FAMILY_ROPE_TYPES.get(config.get("model_type"), LEAN_ROPE_TYPES)
    if (kind := rope_type(config)) not in kinds:
        reasons.append(f"rope_type {kind!r} (it runs {', '.join(kinds)})")
    elif kind == "longrope" and (limit := original_max_positions(config)) < max_model_len:
        reasons.append(f"rope_type 'longrope' past original_max_position_embeddings {limit} (exact only up to that "
                       f"many positions: set option.max_model_len to at most {limit}, now {max_model_len})")
    rope = rope_parameters(config)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        reasons.append(f"partial_rotary_factor {partial}")
    return reasons


def _gemma_problems(config: dict) -> list[str]:
    reasons = []
    if (act := config.get("hidden_activation") or _GEMMA_ACTIVATION) != _GEMMA_ACTIVATION:
        reasons.append(f"hidden_activation {act!r} (only {_GEMMA_ACTIVATION})")
    if config.get("use_bidirectional_attention"):
        reasons.append("use_bidirectional_attention")
    return reasons


def _layer_type_problems(config: dict) -> list[str]:
    """The families with sliding layers: ``layer_types`` must name each layer's kind, and a sliding layer needs a
    window."""
    reasons = []
    layers, layer_types = config.get("num_hidden_layers", 0), config.get("layer_types")
    if layer_types is not None and (len(layer_types) != layers
                                    or set(layer_types) - {"sliding_attention", "full_attention"}):
        reasons.append(f"layer_types {layer_types} (for {layers} layers of sliding_attention / full_attention)")
    elif any(sliding_layers(config)) and not with_family_defaults(config).get("sliding_window"):
        reasons.append("sliding_attention layers without a sliding_window")
    return reasons


def _moe_problems(config: dict) -> list[str]:
    if config.get("model_type") not in MOE_TENSORS:
        return []
    counts = {config[key] for key in ("num_experts", "num_local_experts") if key in config}
    if len(counts) > 1:  # transformers keeps whichever of the two it reads last
        return [f"num_experts and num_local_experts that differ ({', '.join(map(str, sorted(counts)))})"]
    top_k = with_family_defaults(config)["num_experts_per_tok"]
    if any(moe_layers(config)) and not 0 < top_k <= num_experts(config):
        return [f"num_experts_per_tok {top_k} of {num_experts(config)} experts"]
    return []


def sliding_window(config: dict) -> int | None:
    """The attention window some layer uses, or None when every layer sees every earlier position."""
    window = config.get("sliding_window")
    if not window:
        return None
    layer_types = config.get("layer_types")
    if layer_types is not None:  # (a sliding layer whose config drops the window fails in transformers itself)
        return window if "sliding_attention" in layer_types else None
    # these families' configs drop the window unless use_sliding_window is set
    if config.get("model_type") in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "smollm3") and not config.get(
            "use_sliding_window", False):
        return None
    return window


def _tensor_problems(config: dict, names: set[str]) -> list[str]:
    optional = () if config.get("model_type") in _NO_OPTIONAL_TENSORS else _OPTIONAL_LAYER_TENSORS
    required = {"model.embed_tokens.weight", "model.norm.weight"}
    if not with_family_defaults(config).get("tie_word_embeddings", False):
        required.add("lm_head.weight")
    known = required | {"lm_head.weight"}
    for i, moe in enumerate(moe_layers(config)):
        layer_tensors = _layer_tensors(config, moe)
        required |= {f"model.layers.{i}.{n}" for n in layer_tensors}
        known |= {f"model.layers.{i}.{n}" for n in layer_tensors + optional}
        biases = {f"model.layers.{i}.{n}" for n in _OPTIONAL_LAYER_TENSORS[:3]} & names
        if biases and len(biases) != 3:
            return [f"q/k/v biases on only some projections of layer {i}"]
    reasons = []
    if missing := sorted(required - names):
        reasons.append(f"a checkpoint without {_some(missing)}")
    if extra := sorted(n for n in names - known if not n.endswith("rotary_emb.inv_freq")):
        reasons.append(f"tensors it would not read: {_some(extra)}")
    return reasons


def _layer_tensors(config: dict, moe: bool) -> tuple[str, ...]:
    """One layer's tensor names; an MoE layer has its router and experts in place of the MLP's three."""
    family = config.get("model_type")
    names = _FAMILY_LAYER_TENSORS.get(family, _LAYER_TENSORS)
    if not moe:
        return names
    router, expert = MOE_TENSORS[family]
    experts = tuple(dict.fromkeys(n.format(e=e) for e in range(num_experts(config)) for n in expert))
    shared = SHARED_EXPERT_TENSORS.get(family, ())
    return tuple(n for n in names if n not in _MLP_TENSORS) + (router,) + experts + shared


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
