"""What a family's checkpoint becomes at load. ``FamilySpec`` holds what the config decides once (which norms a
block has, its softcaps and window, how the embeddings and logits are scaled); ``LayerBuilder`` turns the
checkpoint's tensors into each layer's weights under it (``Layer``: fused q/k/v and gate/up, the attention scale
and granite's multipliers folded into the weights, each layer's q/k treatment picked from ``qk_split`` as its
``split``), and the rotary tables. The decoder's layer loop (``decoder``) only reads the result: a step of one
family runs just what its math needs, whatever else the engine implements. Which families and features exist is
``support``'s.

May import: the model room's own modules (checkpoint reading, Linear and MoE layers, the q/k helpers, LoRA's folds,
what the families' configs mean). Nothing else of the engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from handler.engine.model.checkpoint import read_tensors
from handler.engine.model.family_config import (
    GEMMA_TYPES,
    layer_rope_configs,
    moe_layers,
    original_max_positions,
    rope_layers,
    rope_parameters,
    rope_type,
    sliding_layers,
)
from handler.engine.model.linear import DenseLinear, Int8DynamicLinear
from handler.engine.model.lora import fold
from handler.engine.model.moe import ACTIVATIONS, GatedMLP, SparseMoE, load_moe
from handler.engine.model.qk_split import helpers as qk_helpers


@dataclass(slots=True)
class Layer:
    """One block's weights. Pre-norm families (all but olmo2) have ``input_norm`` and ``post_norm`` (before
    attention and before the MLP); olmo2 has neither but ``attn_out_norm`` and ``mlp_out_norm`` (on each sublayer's
    output, before the residual add). ``split`` turns the qkv projection into q, k (normed where the family norms
    them, rotated where the layer uses RoPE) and v: picked at load, so a family pays only for what it has. ``mlp``
    is the feed-forward sublayer: a gated MLP, or an MoE layer's router and experts (``moe``). The gemma families
    have all four norms (``post_norm`` before the MLP, the two ``*_out_norm`` on the sublayers' outputs);
    ``sliding``: the layer attends within the model's sliding window. ``sinks``: gpt_oss's attention sinks, one
    logit per query head ``[kv_heads, groups, 1]`` (``attention.attend``)."""

    input_norm: torch.Tensor | None
    qkv: DenseLinear | Int8DynamicLinear
    out: DenseLinear | Int8DynamicLinear
    post_norm: torch.Tensor | None
    mlp: GatedMLP | SparseMoE
    split: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    sliding: bool = False
    sinks: torch.Tensor | None = None
    # what load folded into each Linear site's input and output (``lora.fold``), for adapters to follow
    folds: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """What a config decides once for every layer of the model."""

    family: str | None
    gemma: bool                      # gemma2 / gemma3_text: (1 + w) norms, four per layer, GELU-tanh
    post_norms: bool                 # olmo2: norms on each sublayer's output, none before
    window: int | None               # the sliding window of the layers that have one
    attn_softcap: float | None       # gemma2: tanh(x / cap) * cap on the attention scores
    final_softcap: float | None      # gemma families: the same on the logits

    @classmethod
    def from_config(cls, config: dict) -> FamilySpec:
        family = config.get("model_type")
        gemma = family in GEMMA_TYPES
        sliding = sliding_layers(config)
        # gemma3's config may name an attention cap, which transformers does not apply
        return cls(family=family, gemma=gemma, post_norms=family == "olmo2",
                   window=config["sliding_window"] if any(sliding) else None,
                   attn_softcap=config.get("attn_logit_softcapping") if family == "gemma2" else None,
                   final_softcap=config.get("final_logit_softcapping") if gemma else None)

    @property
    def granite(self) -> bool:
        """granite scales the embeddings, each sublayer's output and the logits: folded into the weights."""
        return self.family == "granite"


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def shape_from_config(config: dict) -> ModelShape:
    num_heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    return ModelShape(
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden // num_heads,
        vocab_size=config["vocab_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
    )


def load_state_dict(model_dir: Path, linears: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of every safetensors file in the folder, copied out of the file mapping (``checkpoint``);
    ``linears=False``: without the layers' projection weights and a separate head (left unread)."""
    return read_tensors(model_dir, skip=None if linears else is_linear_weight)


def is_linear_weight(name: str) -> bool:
    """A weight of a Linear the int8 form replaces (``quantize``): the layers' projections and an untied head."""
    return name == "lm_head.weight" or (name.startswith("model.layers.") and name.endswith("_proj.weight"))


class LayerBuilder:
    """The model's weights from the checkpoint's tensors, as ``spec`` says, in ``dtype`` on ``device``; every Linear
    is made dense (``handler.engine.model.quantize`` swaps in int8 layers after calibration)."""

    def __init__(self, spec: FamilySpec, shape: ModelShape, config: dict, dtype: torch.dtype,
                 device: torch.device, linears: bool = True) -> None:
        """``linears=False``: the state has no Linear weights (``load_state_dict``), and each Linear is built
        without one, for ``packed.load`` to replace before the model runs."""
        self.spec, self.shape, self.config = spec, shape, config
        self.dtype, self.device, self.linears = dtype, device, linears

    def embeddings(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        embed = state["model.embed_tokens.weight"]
        if self.spec.granite:
            embed = embed * self.config["embedding_multiplier"]
        embed = embed.to(self.device, self.dtype)
        if self.spec.gemma:  # scaled by sqrt(hidden) in the embedding's dtype, as transformers does (not the head)
            embed = embed * torch.tensor(self.shape.hidden_size**0.5, dtype=self.dtype)
        return embed

    def layers(self, state: dict[str, torch.Tensor]) -> list[Layer]:
        config = self.config
        rope, moe, sliding = rope_layers(config), moe_layers(config), sliding_layers(config)
        return [self.layer(state, i, self.dense, config, rope[i], moe[i], sliding[i])
                for i in range(self.shape.num_layers)]

    def lm_head(self, state: dict[str, torch.Tensor]) -> DenseLinear:
        def weight() -> torch.Tensor:
            head = state.get("lm_head.weight", state["model.embed_tokens.weight"])  # tied embeddings
            return head / self.config["logits_scaling"] if self.spec.granite else head

        return self.linear(weight, None)

    def dense(self, weight: torch.Tensor, bias: torch.Tensor | None) -> DenseLinear:
        bias = None if bias is None else bias.to(self.device, self.dtype)
        return DenseLinear(weight.to(self.device, self.dtype), bias)

    def linear(self, weight: Callable[[], torch.Tensor], bias: torch.Tensor | None) -> DenseLinear:
        """``dense(weight(), bias)``; without ``linears``, a Linear whose weight is None (``weight`` not called)."""
        if not self.linears:
            return DenseLinear(None, None if bias is None else bias.to(self.device, self.dtype))
        return self.dense(weight(), bias)

    def norm(self, state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return self.norm_weight(state[name]).to(self.device, self.dtype)

    def norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """An RMSNorm's multiplier: the gemma families' norms multiply by ``1 + w`` (computed in fp32 there)."""
        return weight.float() + 1.0 if self.spec.gemma else weight

    def layer_norms(self, state: dict[str, torch.Tensor], p: str) -> dict[str, torch.Tensor | None]:
        """Which of a layer's norms each family has, and where they sit (``Layer``)."""
        def norm(name: str) -> torch.Tensor:
            return self.norm(state, f"{p}{name}_layernorm.weight")

        if self.spec.gemma:
            return {"input_norm": norm("input"), "post_norm": norm("pre_feedforward"),
                    "attn_out_norm": norm("post_attention"), "mlp_out_norm": norm("post_feedforward")}
        if self.spec.post_norms:
            return {"input_norm": None, "post_norm": None, "attn_out_norm": norm("post_attention"),
                    "mlp_out_norm": norm("post_feedforward")}
        return {"input_norm": norm("input"), "post_norm": norm("post_attention")}

    def layer(self, state: dict[str, torch.Tensor], i: int, make, config: dict, use_rope: bool,
               use_moe: bool, sliding: bool) -> Layer:
        p = f"model.layers.{i}."
        s = self.shape
        family = config.get("model_type")
        # attention's scale is folded into the query: into the projection (RoPE is linear) or, where q is normed
        # after the projection (which would undo a scaled projection), into the norm's weight
        scale = config["attention_multiplier"] if family == "granite" else s.head_dim**-0.5
        if self.spec.gemma:
            scale = config["query_pre_attn_scalar"] ** -0.5
        if self.spec.attn_softcap:  # the scores divided by the cap before tanh (``attend``): folded in with the scale
            scale /= self.spec.attn_softcap
        q_norms = ("qwen3", "qwen3_moe", "olmo2", "gemma3_text")
        q_norm = state[f"{p}self_attn.q_norm.weight"] if family in q_norms else None
        project_scale = 1.0 if q_norm is not None else scale

        def qkv_weight() -> torch.Tensor:
            attn = _qkv_weights(state, p, family, s)
            attn[0] = attn[0] * project_scale
            return torch.cat(attn)

        biases = [state.get(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
        biases[0] = None if biases[0] is None else biases[0] * project_scale
        qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        out_bias = state.get(f"{p}self_attn.o_proj.bias")
        # granite's residual_multiplier scales each sublayer's output: its last Linear
        residual = config["residual_multiplier"] if family == "granite" else None
        if residual is not None:
            out_bias = None if out_bias is None else out_bias * residual

        def out_weight() -> torch.Tensor:
            weight = state[f"{p}self_attn.o_proj.weight"]
            return weight if residual is None else weight * residual
        heads = {"num_heads": s.num_heads, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim}
        helpers = qk_helpers(self.dtype, self.device)
        if q_norm is None:
            split = partial(helpers["split_and_rotate" if use_rope else "split"], **heads)
        else:
            k_norm = self.norm(state, f"{p}self_attn.k_norm.weight")
            q_norm = (self.norm_weight(q_norm) * scale).to(self.device, self.dtype)
            if family == "olmo2":  # over the whole q and k projections
                split = partial(helpers["split_norm_rotate"], **heads, q_norm=q_norm, k_norm=k_norm,
                                eps=s.rms_norm_eps)
            else:  # qwen3, gemma3_text: over each head, one weight per head dim
                weight = torch.cat([q_norm.expand(s.num_heads, -1), k_norm.expand(s.num_kv_heads, -1)])
                split = partial(helpers["split_head_norm_rotate"], **heads, qk_norm=weight, eps=s.rms_norm_eps)
        sinks = state.get(f"{p}self_attn.sinks")
        folds: dict = {}
        if project_scale != 1.0:  # the query rows carry the attention scale
            kv_rows = 2 * s.num_kv_heads * s.head_dim
            fold(folds, "qkv", output=torch.cat([torch.full((s.num_heads * s.head_dim,), float(project_scale)),
                                                 torch.ones(kv_rows)]))
        if residual is not None:
            fold(folds, "out", output=residual)
            fold(folds, "down", output=residual)
        return Layer(
            folds=folds,
            **self.layer_norms(state, p),
            qkv=self.linear(qkv_weight, qkv_bias),
            out=self.linear(out_weight, out_bias),
            mlp=self.feed_forward(state, p, make, config, use_moe, residual),
            split=split,
            sliding=sliding,
            sinks=None if sinks is None else sinks.to(self.device, self.dtype).view(s.num_kv_heads, -1, 1),
        )

    def feed_forward(self, state: dict[str, torch.Tensor], p: str, make, config: dict, use_moe: bool,
                      down_scale: float | None) -> GatedMLP | SparseMoE:
        """The layer's gated MLP (gate and up fused here; phi3's checkpoint has them fused already), or its
        experts; ``down_scale``: granite's residual multiplier, folded into the down projection."""
        if use_moe:
            return load_moe(state, p, config, make, lambda router: router.to(self.device, self.dtype))
        def gate_up() -> torch.Tensor:
            if config.get("model_type") == "phi3":
                return state[f"{p}mlp.gate_up_proj.weight"]
            return torch.cat([state[f"{p}mlp.gate_proj.weight"], state[f"{p}mlp.up_proj.weight"]])

        def down() -> torch.Tensor:
            weight = state[f"{p}mlp.down_proj.weight"]
            return weight if down_scale is None else weight * down_scale

        activation = ACTIVATIONS["gelu_pytorch_tanh" if self.spec.gemma else "silu"]
        return GatedMLP(self.linear(gate_up, None), self.linear(down, None), activation)

    def rope(self, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[max_positions, head_dim]``; for the gemma families ``[2, max_positions, head_dim]``, the
        full-attention layers' table then the sliding layers' (gemma3_text's differ, gemma2's are one)."""
        configs = layer_rope_configs(config)
        cos, sin = self.rotary_tables(configs[False])
        if not self.spec.gemma:
            return cos, sin
        local_cos, local_sin = (cos, sin) if configs[True] is configs[False] else self.rotary_tables(configs[True])
        return torch.stack([cos, local_cos]), torch.stack([sin, local_sin])

    def rotary_tables(self, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for every position: ``[max_positions, head_dim]``.

        Plain RoPE is computed here (importing transformers' model code costs a second of start-up); every scaled
        variant comes from transformers' own rotary module."""
        rope = rope_parameters(config)
        if rope_type(config) == "default":
            theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
            dim = self.shape.head_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            freqs = torch.outer(torch.arange(self.shape.max_position_embeddings).float(), inv_freq)
            table = torch.cat((freqs, freqs), dim=-1)
            return table.cos().to(self.device, self.dtype), table.sin().to(self.device, self.dtype)
        from transformers import AutoConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        if config.get("model_type") == "gemma3_text":  # one layer type's settings, flat: as llama's config has them
            keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                    "rope_parameters")
            config = {"model_type": "llama", **{key: config[key] for key in keys if key in config}}
        hf_config = AutoConfig.for_model(**config)
        rotary = LlamaRotaryEmbedding(hf_config)
        positions = torch.arange(_rotary_positions(config, self.shape.max_position_embeddings)).unsqueeze(0)
        probe = torch.zeros(1, dtype=torch.float32)
        cos, sin = rotary(probe, positions)
        return cos[0].to(self.device, self.dtype), sin[0].to(self.device, self.dtype)


def _qkv_weights(state: dict[str, torch.Tensor], p: str, family: str | None, s: ModelShape) -> list[torch.Tensor]:
    """The q, k and v projection weights; phi3 stores them as one ``qkv_proj`` (q rows, then k, then v)."""
    if family == "phi3":
        kv_rows = s.num_kv_heads * s.head_dim
        return list(state[f"{p}self_attn.qkv_proj.weight"].split([s.num_heads * s.head_dim, kv_rows, kv_rows]))
    return [state[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]


def _rotary_positions(config: dict, max_positions: int) -> int:
    """How many positions the rotary table covers. longrope (phi3) picks its short or long factors by the length
    of the whole sequence in transformers, so the table is the short one, exact up to
    ``original_max_position_embeddings``: ``support`` refuses a longer ``max_model_len``. (Given every position at
    once, transformers' rotary module would pick the long factors for all of them.)"""
    if rope_type(config) == "longrope":
        return min(max_positions, original_max_positions(config))
    return max_positions


def attention_tokens(config: dict, s: ModelShape) -> int:
    """About how many cached keys one token's attention reads for the arithmetic of its Linear layers: the weight
    elements a token multiplies in a layer (projections, the gated MLP or an MoE layer's routed and shared
    experts) over the q.k and p.v products per key (``2 * heads * head_dim``). The scheduler's prefill cost model."""
    ffn = config.get("moe_intermediate_size") or config["intermediate_size"]
    ffn *= config.get("num_experts_per_tok", 1) if config.get("num_local_experts") or config.get("num_experts") else 1
    ffn += config.get("shared_expert_intermediate_size") or 0
    attention = s.hidden_size * (2 * s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    return max(1, (attention + 3 * s.hidden_size * ffn) // (2 * s.num_heads * s.head_dim))
