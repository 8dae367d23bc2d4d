"""A lean decoder-only transformer for Llama-family checkpoints, built for continuous batching.

Why not the transformers module: its forward builds masks, caches and position tensors in Python on every call,
and on a 2-core CPU that per-op overhead dominates a small model's decode step. Here a step is one pass over a
flat batch of tokens: every Linear runs once on all rows (decode rows and prefill chunks together), and attention
reads each row's own keys (``attention``: one kernel call a layer on CPU). The KV cache is slot-based
(``kv_cache``), so sequences join and leave without touching the others. What each family's checkpoint becomes is
decided at load (``family``); the layout of a step's rows and what they attend is ``layout``'s.

The weights come straight from the checkpoint's safetensors; the rotary tables come from transformers' own rotary
module so every RoPE scaling variant the config names is honoured. ``test_model_matches_transformers`` checks the
logits against ``LlamaForCausalLM`` itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from handler.engine.model.attention import pick
from handler.engine.model.family import (
    FamilySpec,
    LayerBuilder,
    attention_tokens,
    load_state_dict,
    read_config,
    shape_from_config,
)
from handler.engine.model.family_config import with_family_defaults
from handler.engine.model.kernels import fused_rms_norm
from handler.engine.model.kv_cache import KVCache
from handler.engine.model.layout import KVStore, StepLayout, with_window
from handler.engine.model.linear import Int8DynamicLinear
from handler.engine.model.moe import GatedMLP


class DecoderModel:
    """Llama-family forward over a flat batch with a slot-based KV cache.

    Family differences (``support``) are settled at load (``family``), into the weights where they are linear
    (granite's multipliers, the attention scale) or into each layer's ``split`` and the block loop, so the per-step
    work of a family is only what its math needs: a llama step runs the same ops whatever else the engine
    implements."""

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device, config: dict | None = None,
                 state: dict[str, torch.Tensor] | None = None, linears: bool = True) -> None:
        """``config`` and ``state`` default to the folder's own; a vision-language model passes its language
        model's config and tensors, renamed to Llama keys (``handler.engine.model.vision``). ``linears=False``:
        the Linears' weights are not read (each Linear is built without one), for a caller that gives the model
        its int8 Linears (``packed.load``) before it runs."""
        config = with_family_defaults(read_config(model_dir) if config is None else config)
        self.shape = shape_from_config(config)
        self.spec = FamilySpec.from_config(config)
        self.dtype, self.device = dtype, device
        self.adapter_batch = None   # lora.AdapterBatch once adapters are enabled (``lora.enable_adapters``)
        state = load_state_dict(model_dir, linears) if state is None else state
        build = LayerBuilder(self.spec, self.shape, config, dtype, device, linears)
        self.embed = build.embeddings(state)
        self.layers = build.layers(state)
        self.final_norm = build.norm(state, "model.norm.weight")
        self.lm_head = build.lm_head(state)
        self.cos, self.sin = build.rope(config)
        self.attention_tokens = attention_tokens(config, self.shape)
        # a step's attention: our kernel on CPU where it runs, else torch's matmuls (``attention``)
        self.attention = pick(self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim, device, dtype,
                              self.spec.attn_softcap, self.spec.window)
        # RMSNorm: on CPU in fp32 our kernel's one call, the same bits as torch's seven ops (``kernels.rms_norm.c``)
        fused = fused_rms_norm() if device.type == "cpu" and dtype == torch.float32 else None
        self.norm = fused or _rms_norm
        self._norm_lanes = getattr(fused, "lanes", None)  # ``_normed``: the kernel computes our norm in its call
        self._blocks = (self._sandwich_blocks if self.spec.gemma
                        else self._post_norm_blocks if self.spec.post_norms else self._pre_norm_blocks)

    def new_cache(self, max_slots: int, max_len: int) -> KVCache:
        s = self.shape
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype, self.device, max_slots, max_len)

    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * self.embed.element_size()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, layout: StepLayout, cache: KVStore,
                logit_rows: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                hidden: bool = False) -> torch.Tensor:
        """tokens, positions: ``[num_rows]``; returns fp32 logits ``[len(logit_rows), vocab]`` (``hidden``: the
        final norm's output of those rows, ``[len(logit_rows), hidden]``, what embeddings pool).

        ``embeds``: ``(rows [k], values [k, hidden])``, input embeddings that replace the token embeddings of
        those rows (a vision model's image features at its image-token positions)."""
        x = F.embedding(tokens, self.embed)  # [rows, hidden]
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        # [rows, 1, head_dim] (gemma: [2, rows, 1, head_dim], full-attention and sliding layers' tables)
        cos, sin = self.cos[..., positions, :].unsqueeze(-2), self.sin[..., positions, :].unsqueeze(-2)
        if self.spec.window is not None and layout.window != self.spec.window:
            with_window(layout, self.spec.window)
        x = self._blocks(x, cos, sin, layout, cache)
        x = self.norm(x[logit_rows], self.final_norm, self.shape.rms_norm_eps)
        if hidden:
            return x.float()
        logits = self.lm_head(x)
        if self.spec.final_softcap:
            logits = torch.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        return logits.float()

    def _pre_norm_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: StepLayout,
                         cache: KVStore) -> torch.Tensor:
        """The llama block; gpt_oss's layers add sinks to attention and alternate sliding and full attention."""
        eps = self.shape.rms_norm_eps
        for index, layer in enumerate(self.layers):
            attention = self.attention(*layer.split(self._normed(layer.qkv, x, layer.input_norm), cos, sin), index,
                                        layout, cache, sliding=layer.sliding, sinks=layer.sinks)
            x = _plus(layer.out, attention, x)
            mlp = layer.mlp
            if type(mlp) is GatedMLP:
                x = self._mlp(mlp, x, layer.post_norm)
            else:
                x = x + mlp(self.norm(x, layer.post_norm, eps))
        return x

    def _normed(self, linear: object, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``linear(norm(x, weight))``: one call of the int8 kernel where it takes the rows and the norm is our
        kernel's (the same bits: ``Int8DynamicLinear.fused``). With ``_plus``, a decode step of the embedded model
        makes 60 calls fewer: 9.84 -> 9.32 ms a step here (batch 1, medians of 12 alternated runs)."""
        eps = self.shape.rms_norm_eps
        if self._norm_lanes is not None and type(linear) is Int8DynamicLinear:
            y = linear.fused(x, norm=(weight, eps, self._norm_lanes))
            if y is not None:
                return y
        return linear(self.norm(x, weight, eps))

    def _mlp(self, mlp: GatedMLP, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x + mlp(norm(x, weight))``: one call of the int8 kernel where it takes the MLP (the same bits:
        ``GatedMLP.fused``), else the norm and gate_up in one (``_normed``) and down with the add in another."""
        if self._norm_lanes is not None:
            y = mlp.fused(x, residual=x, norm=(weight, self.shape.rms_norm_eps, self._norm_lanes))
            if y is not None:
                return y
        return _plus(mlp.down, mlp.gated(self._normed(mlp.gate_up, x, weight)), x)

    def _post_norm_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: StepLayout,
                          cache: KVStore) -> torch.Tensor:
        """olmo2: each sublayer reads the residual stream itself and its output is normed before the add."""
        eps = self.shape.rms_norm_eps
        for index, layer in enumerate(self.layers):
            h = layer.out(self.attention(*layer.split(layer.qkv(x), cos, sin), index, layout, cache))
            x = x + self.norm(h, layer.attn_out_norm, eps)
            x = x + self.norm(layer.mlp(x), layer.mlp_out_norm, eps)
        return x

    def _sandwich_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: StepLayout,
                         cache: KVStore) -> torch.Tensor:
        """gemma2, gemma3_text: pre-norms, and norms on each sublayer's output before the residual add; a sliding
        layer attends within the window, with its own RoPE table (``_rope``)."""
        eps = self.shape.rms_norm_eps
        for index, layer in enumerate(self.layers):
            kind = int(layer.sliding)
            h = self.norm(x, layer.input_norm, eps)
            h = layer.out(self.attention(*layer.split(layer.qkv(h), cos[kind], sin[kind]), index, layout, cache,
                                          sliding=layer.sliding))
            x = x + self.norm(h, layer.attn_out_norm, eps)
            h = layer.mlp(self.norm(x, layer.post_norm, eps))
            x = x + self.norm(h, layer.mlp_out_norm, eps)
        return x


def _plus(linear: object, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x)``, the add in the int8 kernel's call where it takes the rows (the same bits)."""
    if type(linear) is Int8DynamicLinear:
        y = linear.fused(x, residual=residual)
        if y is not None:
            return y
    return residual + linear(x)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
