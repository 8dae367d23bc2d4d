"""A lean decoder-only transformer for Llama-family checkpoints, built for continuous batching.

Why not the transformers module: its forward builds masks, caches and position tensors in Python on every call,
and on a 2-core CPU that per-op overhead dominates a small model's decode step. Here a step is one pass over a
flat batch of tokens: every Linear runs once on all rows (decode rows and prefill chunks together), and only
attention is split, batched across all decode rows and per prefill chunk. The KV cache is slot-based
(``kv_cache``), so sequences join and leave without touching the others.

The weights come straight from the checkpoint's safetensors; the rotary tables come from transformers' own rotary
module so every RoPE scaling variant the config names is honoured. ``test_model_matches_transformers`` checks the
logits against ``LlamaForCausalLM`` itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from handler.engine.checkpoint import read_tensors
from handler.engine.kv_cache import KEY_BLOCK, KVCache, KVSpace, whole_blocks
from handler.engine.linear import DenseLinear, Int8DynamicLinear
from handler.engine.moe import ACTIVATIONS, GatedMLP, SparseMoE, load_moe
from handler.engine.support import (
    GEMMA_TYPES,
    layer_rope_configs,
    moe_layers,
    original_max_positions,
    rope_layers,
    rope_parameters,
    rope_type,
    sliding_layers,
    with_family_defaults,
)


@dataclass(slots=True)
class Layer:
    """One block's weights. Pre-norm families (all but olmo2) have ``input_norm`` and ``post_norm`` (before
    attention and before the MLP); olmo2 has neither but ``attn_out_norm`` and ``mlp_out_norm`` (on each sublayer's
    output, before the residual add). ``split`` turns the qkv projection into q, k (normed where the family norms
    them, rotated where the layer uses RoPE) and v: picked at load, so a family pays only for what it has. ``mlp``
    is the feed-forward sublayer: a gated MLP, or an MoE layer's router and experts (``moe``). The gemma families
    have all four norms (``post_norm`` before the MLP, the two ``*_out_norm`` on the sublayers' outputs);
    ``sliding``: the layer attends within the model's sliding window. ``sinks``: gpt_oss's attention sinks, one
    logit per query head ``[kv_heads, groups, 1]`` (``_attend``)."""

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


@dataclass(slots=True)
class StepLayout:
    """Where the rows of one flat step batch go.

    Rows ``[0, num_decode)`` are one token per decoding slot, in ``decode_groups``: runs of slots the cache reads
    as one batch, ``(handle, count)`` (the handle is the cache's: ``(first_slot, count)`` for a dense
    ``KVCache``); then come the prefill chunks, each ``(slot, start, length)`` with its tokens at consecutive
    positions, cut into ``prefill_blocks`` that never cross a multiple of KEY_BLOCK. ``decode_masks`` are one
    ``[count, 1, 1, L]`` per group (L: the group's longest row, in whole KEY_BLOCKs), the ``prefill_masks`` one
    ``[1, 1, G*length, K]`` per block (G query heads share a KV head), K the block's end rounded up to whole
    KEY_BLOCKs.

    Why blocks: a query's attention is computed over exactly the keys its own position decides (whole blocks up to
    its block's end), so it is the same number whether its prompt is prefilled whole, in chunks, or after a cached
    prefix, and whatever else is in the step (measured: keys read up to the chunk's end made a prefix's rows
    differ between a 24- and a 37-token prefill on AVX-512, and int8 turned that into logits 1 apart).

    ``window_decode_masks`` / ``window_prefill_masks``: the same shapes for a model's sliding-window layers (a query
    at ``p`` sees keys in ``(p - window, p]``), None until a model with such layers needs them (``with_window``).
    """

    num_decode: int
    decode_positions: torch.Tensor
    decode_groups: list[tuple[object, int]]
    decode_masks: list[torch.Tensor]
    prefill_blocks: list[tuple[object, int, int]]
    prefill_masks: list[torch.Tensor]
    window: int | None = None
    window_decode_masks: list[torch.Tensor] | None = None
    window_prefill_masks: list[torch.Tensor] | None = None


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


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of every safetensors file in the folder, copied out of the file mapping (``checkpoint``)."""
    return read_tensors(model_dir)


class DecoderModel:
    """Llama-family forward over a flat batch with a slot-based KV cache.

    Family differences (``support``) are settled here at load, into the weights where they are linear (granite's
    multipliers, the attention scale) or into each layer's ``split`` and the block loop, so the per-step work of a
    family is only what its math needs: a llama step runs the same ops whatever else the engine implements."""

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device, config: dict | None = None,
                 state: dict[str, torch.Tensor] | None = None) -> None:
        """``config`` and ``state`` default to the folder's own; a vision-language model passes its language
        model's config and tensors, renamed to Llama keys (``handler.engine.vision``)."""
        config = with_family_defaults(read_config(model_dir) if config is None else config)
        self.shape = shape_from_config(config)
        self.dtype, self.device = dtype, device
        state = load_state_dict(model_dir) if state is None else state
        family = config.get("model_type")
        granite = family == "granite"
        self.gemma = family in GEMMA_TYPES
        make = self._dense  # handler.engine.quantize swaps in int8 layers after calibration
        embed = state["model.embed_tokens.weight"]
        # granite scales the embeddings, each sublayer's output and the logits: folded into the weights
        self.embed = (embed * config["embedding_multiplier"] if granite else embed).to(device, dtype)
        if self.gemma:  # scaled by sqrt(hidden) in the embedding's dtype, as transformers does (not the tied head)
            self.embed = self.embed * torch.tensor(self.shape.hidden_size**0.5, dtype=dtype)
        self.post_norms = family == "olmo2"
        sliding = sliding_layers(config)
        self.window: int | None = config["sliding_window"] if any(sliding) else None
        # gemma2's softcaps: tanh(x / cap) * cap on the attention scores and on the logits (gemma3's config may
        # name an attention cap, which transformers does not apply)
        self.attn_softcap: float | None = config.get("attn_logit_softcapping") if family == "gemma2" else None
        self.final_softcap: float | None = config.get("final_logit_softcapping") if self.gemma else None
        rope, moe = rope_layers(config), moe_layers(config)
        self.layers = [self._layer(state, i, make, config, rope[i], moe[i], sliding[i])
                       for i in range(self.shape.num_layers)]
        self.final_norm = self._norm(state, "model.norm.weight")
        head = state.get("lm_head.weight", embed)  # tied embeddings
        self.lm_head = make(head / config["logits_scaling"] if granite else head, None)
        self.cos, self.sin = self._rope(config)
        self.attention_tokens = attention_tokens(config, self.shape)
        self._blocks = (self._sandwich_blocks if self.gemma
                        else self._post_norm_blocks if self.post_norms else self._pre_norm_blocks)

    def _dense(self, weight: torch.Tensor, bias: torch.Tensor | None) -> DenseLinear:
        bias = None if bias is None else bias.to(self.device, self.dtype)
        return DenseLinear(weight.to(self.device, self.dtype), bias)

    def _norm(self, state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return self._norm_weight(state[name]).to(self.device, self.dtype)

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """An RMSNorm's multiplier: the gemma families' norms multiply by ``1 + w`` (computed in fp32 there)."""
        return weight.float() + 1.0 if self.gemma else weight

    def _layer_norms(self, state: dict[str, torch.Tensor], p: str) -> dict[str, torch.Tensor | None]:
        """Which of a layer's norms each family has, and where they sit (``Layer``)."""
        def norm(name: str) -> torch.Tensor:
            return self._norm(state, f"{p}{name}_layernorm.weight")

        if self.gemma:
            return {"input_norm": norm("input"), "post_norm": norm("pre_feedforward"),
                    "attn_out_norm": norm("post_attention"), "mlp_out_norm": norm("post_feedforward")}
        if self.post_norms:
            return {"input_norm": None, "post_norm": None, "attn_out_norm": norm("post_attention"),
                    "mlp_out_norm": norm("post_feedforward")}
        return {"input_norm": norm("input"), "post_norm": norm("post_attention")}

    def _layer(self, state: dict[str, torch.Tensor], i: int, make, config: dict, use_rope: bool,
               use_moe: bool, sliding: bool) -> Layer:
        p = f"model.layers.{i}."
        s = self.shape
        family = config.get("model_type")
        # attention's scale is folded into the query: into the projection (RoPE is linear) or, where q is normed
        # after the projection (which would undo a scaled projection), into the norm's weight
        scale = config["attention_multiplier"] if family == "granite" else s.head_dim**-0.5
        if self.gemma:
            scale = config["query_pre_attn_scalar"] ** -0.5
        if self.attn_softcap:  # the scores divided by the cap before tanh (``_attend``): folded in with the scale
            scale /= self.attn_softcap
        q_norms = ("qwen3", "qwen3_moe", "olmo2", "gemma3_text")
        q_norm = state[f"{p}self_attn.q_norm.weight"] if family in q_norms else None
        project_scale = 1.0 if q_norm is not None else scale
        attn = _qkv_weights(state, p, family, s)
        attn[0] = attn[0] * project_scale
        biases = [state.get(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
        biases[0] = None if biases[0] is None else biases[0] * project_scale
        qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        out_weight, out_bias = state[f"{p}self_attn.o_proj.weight"], state.get(f"{p}self_attn.o_proj.bias")
        residual = None
        if family == "granite":  # residual_multiplier scales each sublayer's output: its last Linear
            residual = config["residual_multiplier"]
            out_weight = out_weight * residual
            out_bias = None if out_bias is None else out_bias * residual
        heads = {"num_heads": s.num_heads, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim}
        if q_norm is None:
            split = partial(_split_and_rotate if use_rope else _split, **heads)
        else:
            k_norm = self._norm(state, f"{p}self_attn.k_norm.weight")
            q_norm = (self._norm_weight(q_norm) * scale).to(self.device, self.dtype)
            if family == "olmo2":  # over the whole q and k projections
                split = partial(_split_norm_rotate, **heads, q_norm=q_norm, k_norm=k_norm, eps=s.rms_norm_eps)
            else:  # qwen3, gemma3_text: over each head, one weight per head dim
                weight = torch.cat([q_norm.expand(s.num_heads, -1), k_norm.expand(s.num_kv_heads, -1)])
                split = partial(_split_head_norm_rotate, **heads, qk_norm=weight, eps=s.rms_norm_eps)
        sinks = state.get(f"{p}self_attn.sinks")
        return Layer(
            **self._layer_norms(state, p),
            qkv=make(torch.cat(attn), qkv_bias),
            out=make(out_weight, out_bias),
            mlp=self._feed_forward(state, p, make, config, use_moe, residual),
            split=split,
            sliding=sliding,
            sinks=None if sinks is None else sinks.to(self.device, self.dtype).view(s.num_kv_heads, -1, 1),
        )

    def _feed_forward(self, state: dict[str, torch.Tensor], p: str, make, config: dict, use_moe: bool,
                      down_scale: float | None) -> GatedMLP | SparseMoE:
        """The layer's gated MLP (gate and up fused here; phi3's checkpoint has them fused already), or its
        experts; ``down_scale``: granite's residual multiplier, folded into the down projection."""
        if use_moe:
            return load_moe(state, p, config, make, lambda router: router.to(self.device, self.dtype))
        if config.get("model_type") == "phi3":
            gate_up = state[f"{p}mlp.gate_up_proj.weight"]
        else:
            gate_up = torch.cat([state[f"{p}mlp.gate_proj.weight"], state[f"{p}mlp.up_proj.weight"]])
        down = state[f"{p}mlp.down_proj.weight"]
        activation = ACTIVATIONS["gelu_pytorch_tanh" if self.gemma else "silu"]
        return GatedMLP(make(gate_up, None), make(down if down_scale is None else down * down_scale, None),
                        activation)

    def _rope(self, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[max_positions, head_dim]``; for the gemma families ``[2, max_positions, head_dim]``, the
        full-attention layers' table then the sliding layers' (gemma3_text's differ, gemma2's are one)."""
        configs = layer_rope_configs(config)
        cos, sin = self._rotary_tables(configs[False])
        if not self.gemma:
            return cos, sin
        local_cos, local_sin = (cos, sin) if configs[True] is configs[False] else self._rotary_tables(configs[True])
        return torch.stack([cos, local_cos]), torch.stack([sin, local_sin])

    def _rotary_tables(self, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
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

    def new_cache(self, max_slots: int, max_len: int) -> KVCache:
        s = self.shape
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype, self.device, max_slots, max_len)

    def new_space(self, budget: int, max_len: int, max_slots: int, prefix_caching: bool = True) -> KVSpace:
        """The engine's budgeted KV memory (``kv_cache.KVSpace``)."""
        s = self.shape
        return KVSpace(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype, self.device, budget=budget,
                       max_len=max_len, max_slots=max_slots, prefix_caching=prefix_caching)

    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * self.embed.element_size()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, layout: StepLayout, cache: KVCache | KVSpace,
                logit_rows: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """tokens, positions: ``[num_rows]``; returns fp32 logits ``[len(logit_rows), vocab]``.

        ``embeds``: ``(rows [k], values [k, hidden])``, input embeddings that replace the token embeddings of
        those rows (a vision model's image features at its image-token positions)."""
        x = F.embedding(tokens, self.embed)  # [rows, hidden]
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        # [rows, 1, head_dim] (gemma: [2, rows, 1, head_dim], full-attention and sliding layers' tables)
        cos, sin = self.cos[..., positions, :].unsqueeze(-2), self.sin[..., positions, :].unsqueeze(-2)
        if self.window is not None and layout.window != self.window:
            with_window(layout, self.window, self.shape.num_heads // self.shape.num_kv_heads)
        x = self._blocks(x, cos, sin, layout, cache)
        x = F.rms_norm(x[logit_rows], (x.shape[-1],), self.final_norm, self.shape.rms_norm_eps)
        logits = self.lm_head(x)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def _pre_norm_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: StepLayout,
                         cache: KVCache | KVSpace) -> torch.Tensor:
        """The llama block; gpt_oss's layers add sinks to attention and alternate sliding and full attention."""
        eps = self.shape.rms_norm_eps
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.input_norm, eps)
            x = x + layer.out(self._attention(*layer.split(layer.qkv(h), cos, sin), index, layout, cache,
                                              sliding=layer.sliding, sinks=layer.sinks))
            x = x + layer.mlp(F.rms_norm(x, (x.shape[-1],), layer.post_norm, eps))
        return x

    def _post_norm_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: StepLayout,
                          cache: KVCache | KVSpace) -> torch.Tensor:
        """olmo2: each sublayer reads the residual stream itself and its output is normed before the add."""
        eps = self.shape.rms_norm_eps
        for index, layer in enumerate(self.layers):
            h = layer.out(self._attention(*layer.split(layer.qkv(x), cos, sin), index, layout, cache))
            x = x + F.rms_norm(h, (x.shape[-1],), layer.attn_out_norm, eps)
            x = x + F.rms_norm(layer.mlp(x), (x.shape[-1],), layer.mlp_out_norm, eps)
        return x

    def _sandwich_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: StepLayout,
                         cache: KVCache | KVSpace) -> torch.Tensor:
        """gemma2, gemma3_text: pre-norms, and norms on each sublayer's output before the residual add; a sliding
        layer attends within the window, with its own RoPE table (``_rope``)."""
        eps = self.shape.rms_norm_eps
        for index, layer in enumerate(self.layers):
            kind = int(layer.sliding)
            h = F.rms_norm(x, (x.shape[-1],), layer.input_norm, eps)
            h = layer.out(self._attention(*layer.split(layer.qkv(h), cos[kind], sin[kind]), index, layout, cache,
                                          sliding=layer.sliding))
            x = x + F.rms_norm(h, (x.shape[-1],), layer.attn_out_norm, eps)
            h = layer.mlp(F.rms_norm(x, (x.shape[-1],), layer.post_norm, eps))
            x = x + F.rms_norm(h, (x.shape[-1],), layer.mlp_out_norm, eps)
        return x

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, layout: StepLayout,
                   cache: KVCache | KVSpace, sliding: bool = False,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
        s = self.shape
        rows = q.shape[0]
        out = torch.empty(rows, s.num_heads * s.head_dim, dtype=q.dtype, device=q.device)
        decode_masks = layout.window_decode_masks if sliding else layout.decode_masks
        prefill_masks = layout.window_prefill_masks if sliding else layout.prefill_masks
        row = 0
        for (group, count), mask in zip(layout.decode_groups, decode_masks, strict=True):
            rows = slice(row, row + count)
            cache.write_decode(layer, group, k[rows], v[rows], layout.decode_positions[rows])
            out[rows] = self._decode_attention(q[rows], layer, group, mask, cache, sinks)
            row += count
        for (slot, start, length), mask in zip(layout.prefill_blocks, prefill_masks, strict=True):
            block = slice(row, row + length)
            cache.write_prefill(layer, slot, start, k[block], v[block])
            out[block] = self._prefill_attention(q[block], layer, slot, mask.shape[-1], mask, cache, sinks)
            row += length
        return out

    def _decode_attention(self, q: torch.Tensor, layer: int, group: object, mask: torch.Tensor,
                          cache: KVCache | KVSpace, sinks: torch.Tensor | None) -> torch.Tensor:
        n, s = q.shape[0], self.shape
        groups = s.num_heads // s.num_kv_heads
        keys, values = cache.decode_view(layer, group, mask.shape[-1])  # [n, kv_heads, L, head_dim]
        # The query heads that share a KV head become that head's "query rows": [n, kv_heads, groups, head_dim]
        out = _attend(q.view(n, s.num_kv_heads, groups, s.head_dim), keys, values, mask, self.attn_softcap, sinks)
        return out.reshape(n, s.num_heads * s.head_dim)

    def _prefill_attention(self, q: torch.Tensor, layer: int, slot: object, length: int, mask: torch.Tensor,
                           cache: KVCache | KVSpace, sinks: torch.Tensor | None) -> torch.Tensor:
        t, s = q.shape[0], self.shape
        groups = s.num_heads // s.num_kv_heads
        keys, values = cache.prefill_view(layer, slot, length)  # [1, kv_heads, length, head_dim]
        q = q.view(t, s.num_kv_heads, groups, s.head_dim).permute(1, 2, 0, 3)  # [kv_heads, groups, t, head_dim]
        if sinks is not None:  # one per query row: [kv_heads, groups * t, 1], (group, t) order
            sinks = sinks.expand(-1, -1, t).reshape(s.num_kv_heads, groups * t, 1)
        out = _attend(q.reshape(1, s.num_kv_heads, groups * t, s.head_dim), keys, values, mask, self.attn_softcap,
                      sinks)
        return out.view(s.num_kv_heads, groups, t, s.head_dim).permute(2, 0, 1, 3).reshape(t, -1)


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


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T + mask) v`` (q already carries 1/sqrt(head_dim)); ``mask`` is 0 where a query may attend,
    -inf elsewhere. With ``softcap`` (gemma2) the scores are ``tanh(q k^T) * softcap`` before the mask, q carrying
    ``1 / softcap`` too: torch's tanh computes every element alike wherever it falls in a vector (measured: the
    same bits alone, at any offset or in any batch), so capped rows stay independent of their neighbours. With
    ``sinks`` (gpt_oss; one logit per query row, broadcast against ``scores[..., :1]``) each row's softmax runs
    over its scores and its sink, whose probability is dropped: the sink takes a share of the weight, no value.

    On CPU as two matmuls and a row softmax rather than SDPA: the CPU flash kernel divides its work between threads
    by the size of the batch, so a decode row's result changed with the number of rows beside it (measured with 2
    threads: 1 row against 3 differed by 6e-8, which int8 turned into a different logprob 12 tokens later). Here
    no sum is split by the batch: the score dot products run over head_dim, each softmax over one row, and the
    value sums over the row's keys (whole KEY_BLOCKs, the masked ones adding exact zeros)."""
    if q.device.type != "cpu" and softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.to(q.dtype), scale=1.0)
    scores = torch.matmul(q, keys.transpose(-1, -2))
    if softcap is not None:
        scores = torch.tanh(scores).mul_(softcap)
    scores = scores.add_(mask)
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    scores = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1)[..., :-1], values)


@torch.jit.script
def _split_and_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv ``[rows, (heads + 2 kv_heads) * head_dim]`` -> q, k (RoPE applied) and v, per head. Scripted: these
    dozen small ops per layer cost more in Python dispatch than in arithmetic."""
    rows = qkv.shape[0]
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(rows, -1, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk = qk * cos + rotated * sin  # [rows, heads + kv_heads, head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(rows, num_kv_heads, head_dim)
    return qk[:, :num_heads], qk[:, num_heads:], v


@torch.jit.script
def _split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
           head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_split_and_rotate`` for a layer without RoPE (smollm3's no-rope layers): cos and sin are not read."""
    rows = qkv.shape[0]
    q = qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(rows, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(rows, num_kv_heads, head_dim)
    return q, k, v


@torch.jit.script
def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = qk.shape[-1] // 2
    return qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin


@torch.jit.script
def _split_head_norm_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                            num_kv_heads: int, head_dim: int, qk_norm: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qwen3: RMSNorm over each q and k head (``qk_norm`` ``[heads + kv_heads, head_dim]``: q_norm's weight,
    carrying the attention scale, on the query heads, k_norm's on the KV heads), then RoPE."""
    rows = qkv.shape[0]
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(rows, -1, head_dim)
    qk = _rotate(torch.rms_norm(qk, [head_dim], None, eps) * qk_norm, cos, sin)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(rows, num_kv_heads, head_dim)
    return qk[:, :num_heads], qk[:, num_heads:], v


@torch.jit.script
def _split_norm_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int, q_norm: torch.Tensor, k_norm: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """olmo2: RMSNorm over the whole q projection and the whole k projection (q_norm carrying the attention
    scale), then per-head RoPE."""
    rows = qkv.shape[0]
    q_size, k_size = num_heads * head_dim, num_kv_heads * head_dim
    q = torch.rms_norm(qkv[:, :q_size], [q_size], q_norm, eps).view(rows, num_heads, head_dim)
    k = torch.rms_norm(qkv[:, q_size: q_size + k_size], [k_size], k_norm, eps).view(rows, num_kv_heads, head_dim)
    v = qkv[:, q_size + k_size:].view(rows, num_kv_heads, head_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def build_layout(decode_positions: list[int], prefill_chunks: list[tuple[object, int, int]], groups: int,
                 device: torch.device, decode_groups: list[tuple[object, int]] | None = None,
                 window: int | None = None) -> StepLayout:
    """Positions tensor and attention masks (0 where a query may attend, -inf elsewhere) for one step. Each decode
    group's attention reads its longest row's keys rounded up to whole KEY_BLOCKs (the rest are masked out).
    Without ``decode_groups`` the decode rows are slots ``0..n-1`` of a dense ``KVCache``. ``window``: also the
    masks of sliding-window layers (else the model adds them when it has such layers, ``with_window``)."""
    num_decode = len(decode_positions)
    positions = torch.tensor(decode_positions, dtype=torch.long, device=device)
    if decode_groups is None:
        decode_groups = [((0, num_decode), num_decode)] if num_decode else []
    blocks = [block for chunk in prefill_chunks for block in _key_blocks(*chunk)]
    decode_masks, masks = _masks(decode_positions, positions, decode_groups, blocks, groups, None)
    layout = StepLayout(num_decode, positions, decode_groups, decode_masks, blocks, masks)
    return layout if window is None else with_window(layout, window, groups)


def with_window(layout: StepLayout, window: int, groups: int) -> StepLayout:
    """Adds the masks of sliding-window layers to ``layout``: a query at ``p`` sees keys in ``(p - window, p]``
    (transformers' ``sliding_window_overlay``), over the same whole KEY_BLOCKs as the full masks."""
    positions = layout.decode_positions
    layout.window_decode_masks, layout.window_prefill_masks = _masks(
        positions.tolist(), positions, layout.decode_groups, layout.prefill_blocks, groups, window)
    layout.window = window
    return layout


def _masks(decode_positions: list[int], positions: torch.Tensor, decode_groups: list[tuple[object, int]],
           blocks: list[tuple[object, int, int]], groups: int,
           window: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The decode groups' masks and the prefill blocks' (``StepLayout``), causal and, with ``window``, within it."""
    device = positions.device
    decode_masks, row = [], 0
    for _handle, count in decode_groups:
        rows = positions[row:row + count]
        keys = torch.arange(whole_blocks(max(decode_positions[row:row + count]) + 1), device=device)
        decode_masks.append(_additive(_allowed(keys, rows, window)).view(count, 1, 1, -1))
        row += count
    masks = []
    for _slot, start, length in blocks:
        query_pos = torch.arange(start, start + length, device=device).repeat(groups)  # (group, t) order
        keys = torch.arange(whole_blocks(start + length), device=device)
        masks.append(_additive(_allowed(keys, query_pos, window)).view(1, 1, groups * length, -1))
    return decode_masks, masks


def _allowed(keys: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[queries, keys]``: True where the query at that position may attend the key."""
    allowed = keys <= queries[:, None]
    return allowed if window is None else allowed & (keys > queries[:, None] - window)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    """A boolean mask (True = may attend) as the float mask attention adds to its scores: 0 or -inf."""
    return torch.where(allowed, 0.0, float("-inf"))


def _key_blocks(slot: object, start: int, length: int) -> list[tuple[object, int, int]]:
    """A prefill chunk cut where its positions cross a multiple of KEY_BLOCK."""
    blocks, end = [], start + length
    while start < end:
        stop = min(end, (start // KEY_BLOCK + 1) * KEY_BLOCK)
        blocks.append((slot, start, stop - start))
        start = stop
    return blocks
