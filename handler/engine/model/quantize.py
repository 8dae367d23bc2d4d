"""Int8 for CPU: SmoothQuant-style smoothing, calibrated at load on a fixed text, then dynamic int8 Linear layers.

Activations of a transformer have a few input channels far larger than the rest; quantising such a row to int8
rounds the ordinary channels away. SmoothQuant (Xiao et al., 2023) divides each input channel ``j`` by
``s_j = max|x_j|^a / max|W_j|^(1-a)`` and multiplies the weight's column ``j`` by the same ``s_j``: the product is
unchanged, but the activation becomes easy to quantise. The division is folded into what produces the activation,
so it costs nothing at run time: the RMSNorm weight before q/k/v and gate/up, the value projection before the
output projection (attention is linear in V), and the up projection before the down projection. A post-norm
block (olmo2) has no norm before q/k/v or gate/up (they read the residual stream itself), so those two stay
unsmoothed there (quantised as they are); q/k norms (qwen3, olmo2) act on the projection's output, which input
smoothing leaves unchanged. The gemma families' four norms (``x * (1 + w)``, the offset folded into the weight at
load) are smoothed like the pre-norm block's: ``input_layernorm`` feeds q/k/v and ``pre_feedforward_layernorm``
gate/up; the two norms on the sublayers' outputs act after out and down, which smoothing leaves unchanged. The
gated MLP's ``act(gate) * up`` is linear in up whatever the activation (GELU-tanh there), so down is smoothed through
up as for SiLU.

An MoE layer (qwen3_moe, qwen2_moe, mixtral, gpt_oss) goes int8 too, expert by expert: the post-attention norm feeds
the router and every expert, so one factor per channel serves them all (from the largest weight of any expert's
gate/up in that channel), folded into the norm, every expert's gate/up (the shared expert's too) and the router (and
the shared expert's gate); each expert's down projection is smoothed from the rows routed to it during calibration
(an expert no calibration row reached is quantised unsmoothed, as is every down projection of gpt_oss's clamped
SwiGLU experts, which are not linear in up; their biases are kept as they are, input smoothing leaving them exact).
The router and the shared expert's gate stay in full precision: they are small, and the router's logits choose which
experts run, so rounding them would change a row's experts, not just a value; both compute each row on its own
(``moe``), so int8 outputs stay independent of the rows beside them. Why int8 rather than dense experts: the experts
are nearly all of an MoE's weights, and a dense fp32 GEMM's rows change with the batch (``moe``'s docstring), which
int8 layers do not.

``max|x_j|`` comes from one dense forward over ``CALIBRATION_TEXT`` at load (about 0.1 s for the embedded model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from handler.engine.model.linear import Int8DynamicLinear
from handler.engine.model.lora import fold
from handler.engine.model.moe import ClampedSwiGLU, GatedMLP, SparseMoE

if TYPE_CHECKING:
    from handler.engine.model.decoder import DecoderModel
    from handler.engine.model.family import Layer

ALPHA = 0.5  # best of 0.5 / 0.7 / 0.8 / 0.9 on the embedded model with a held-out text set (bench/quality.py)
CALIBRATION_TEXT = (
    "<|im_start|>user\nCan you explain how a bicycle stays upright while moving?<|im_end|>\n<|im_start|>assistant\n"
    "A moving bicycle stays upright mostly because the rider steers into any lean, bringing the wheels back under "
    "the centre of mass; the geometry of the fork helps it steer itself.<|im_end|>\n"
    "Weather report: light rain in the morning, clearing by noon, with highs near 18 degrees and a gentle wind "
    "from the west. Tomorrow: sunny.\n"
    "SELECT name, COUNT(*) FROM orders WHERE total > 100 GROUP BY name ORDER BY 2 DESC;\n"
    "for (let i = 0; i < items.length; i++) { console.log(i, items[i]); }\n"
    "In 1969, two astronauts walked on the Moon while a third orbited above, and millions watched on television."
)


class _Recorder:
    """A dense Linear (or an MoE block) that remembers the largest |x| seen per input channel; ``max_abs`` is None
    while it has not been called (an expert no row was routed to)."""

    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inner = inner
        self.max_abs: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.detach().abs().amax(dim=0).float()
        self.max_abs = seen if self.max_abs is None else torch.maximum(self.max_abs, seen)
        return self.inner(x)


def _recorded(layer: Layer) -> list[tuple[str, object, str]]:
    """``(stat name, owner, attribute)`` of what calibration records in a layer: the inputs of qkv and out, then
    of the MLP's gate_up and down, or of an MoE block as a whole (its router's input) and of each expert's down."""
    sites: list[tuple[str, object, str]] = [("qkv", layer, "qkv"), ("out", layer, "out")]
    if isinstance(layer.mlp, SparseMoE):
        sites.append(("moe", layer, "mlp"))
        sites += [(f"experts.{e}.down", expert, "down") for e, expert in enumerate(layer.mlp.experts)
                  if isinstance(expert, GatedMLP)]  # (only these smooth down through up)
        if layer.mlp.shared is not None:
            sites.append(("shared.down", layer.mlp.shared, "down"))
    else:
        sites += [("gate_up", layer.mlp, "gate_up"), ("down", layer.mlp, "down")]
    return sites


def calibrate(model: DecoderModel, token_ids: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per layer, ``max|x_j|`` of the inputs of qkv, out, gate_up and down (an MoE layer: of the block and of
    each expert's down, where some row reached it) over one dense forward."""
    from handler.engine.model.layout import build_layout

    sites = [_recorded(layer) for layer in model.layers]  # read before the MoE blocks are wrapped
    for layer_sites in sites:
        for _name, owner, attribute in layer_sites:
            setattr(owner, attribute, _Recorder(getattr(owner, attribute)))
    cache = model.new_cache(1, len(token_ids))
    cache.ensure(1, len(token_ids))
    groups = model.shape.num_heads // model.shape.num_kv_heads
    positions = torch.arange(len(token_ids), device=model.device)
    layout = build_layout([], [(0, 0, len(token_ids))], groups, model.device)
    model.forward(torch.tensor(token_ids, device=model.device), positions, layout, cache,
                  torch.tensor([len(token_ids) - 1], device=model.device))
    stats = []
    for layer_sites in sites:
        stat = {}
        for name, owner, attribute in layer_sites:
            recorder = getattr(owner, attribute)
            if recorder.max_abs is not None:
                stat[name] = recorder.max_abs
            setattr(owner, attribute, recorder.inner)
        stats.append(stat)
    return stats


def smoothing_factors(act_max: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``s_j`` for one Linear (weight ``[out, in]``), clamped away from zero."""
    return _factors(act_max, weight.abs().amax(dim=0))


def _factors(act_max: torch.Tensor, weight_max: torch.Tensor) -> torch.Tensor:
    """``s_j`` from ``max|x_j|`` and ``max|W_j|`` (over every Linear that reads channel ``j``)."""
    weight_max = weight_max.clamp(min=1e-5)
    return (act_max.clamp(min=1e-5).pow(ALPHA) / weight_max.pow(1 - ALPHA)).clamp(min=1e-2, max=1e2)


def smooth_and_quantize(model: DecoderModel, stats: list[dict[str, torch.Tensor]], block: int | None = None) -> None:
    """Fold smoothing into the producers, then replace every Linear (and the LM head) with int8, its activations
    quantised per ``block`` inputs (``linear.ACTIVATION_BLOCK`` when None)."""
    def int8(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8DynamicLinear:
        return Int8DynamicLinear(weight, bias, block)

    shape = model.shape
    v_start = (shape.num_heads + shape.num_kv_heads) * shape.head_dim
    groups = shape.num_heads // shape.num_kv_heads
    for layer, stat in zip(model.layers, stats, strict=True):
        qkv = layer.qkv.weight.clone()  # updated in place below
        if layer.input_norm is not None:
            s = smoothing_factors(stat["qkv"], qkv)
            layer.input_norm = layer.input_norm / s
            qkv.mul_(s)
            fold(layer.folds, "qkv", input=s)
        # The output projection's input channel h*head_dim+d comes from KV head h // groups, dim d.
        out_s = smoothing_factors(stat["out"], layer.out.weight).view(shape.num_kv_heads, groups, shape.head_dim)
        v_s = out_s.amax(dim=1)  # heads sharing a KV head must share its factor: [kv_heads, head_dim]
        out_s = v_s[:, None, :].expand_as(out_s).reshape(-1)
        qkv[v_start:] = qkv[v_start:] / v_s.reshape(-1, 1)
        fold(layer.folds, "qkv", output=torch.cat([torch.ones(v_start), 1.0 / v_s.reshape(-1)]))
        fold(layer.folds, "out", input=out_s)
        out = layer.out.weight * out_s
        layer.qkv = int8(qkv, _scaled_bias(layer.qkv.bias, v_start, v_s))
        layer.out = int8(out, layer.out.bias)
        if isinstance(layer.mlp, SparseMoE):
            _quantize_moe(layer, stat, int8)
        else:
            _quantize_mlp(layer, stat, int8)
    model.lm_head = int8(model.lm_head.weight, None)


Int8Maker = Callable[[torch.Tensor, torch.Tensor | None], Int8DynamicLinear]


def _quantize_mlp(layer: Layer, stat: dict[str, torch.Tensor], int8: Int8Maker) -> None:
    mlp = layer.mlp
    gate_up = mlp.gate_up.weight.clone()  # updated in place below
    if layer.post_norm is not None:
        s = smoothing_factors(stat["gate_up"], gate_up)
        layer.post_norm = layer.post_norm / s
        gate_up.mul_(s)
        fold(layer.folds, "gate_up", input=s)
    s = smoothing_factors(stat["down"], mlp.down.weight)
    gate_up[mlp.down.weight.shape[1]:] /= s[:, None]  # up rows: silu(gate) * up is linear in up
    fold(layer.folds, "gate_up", output=torch.cat([torch.ones(s.shape[0]), 1.0 / s]))
    fold(layer.folds, "down", input=s)
    down = mlp.down.weight * s
    layer.mlp = GatedMLP(int8(gate_up, None), int8(down, None), mlp.activation)


def _quantize_moe(layer: Layer, stat: dict[str, torch.Tensor], int8: Int8Maker) -> None:
    """One factor per channel for everything the post-attention norm feeds (router and every expert's gate/up),
    then each expert as a dense MLP whose input is already smoothed."""
    moe = layer.mlp
    experts, names = list(moe.experts), [f"experts.{e}.down" for e in range(len(moe.experts))]
    if moe.shared is not None:
        experts, names = [*experts, moe.shared], [*names, "shared.down"]
    s = None
    if layer.post_norm is not None:
        weight_max = torch.stack([expert.gate_up.weight.abs().amax(dim=0) for expert in experts]).amax(dim=0)
        s = _factors(stat["moe"], weight_max)
        layer.post_norm = layer.post_norm / s
        moe.router = moe.router * s.to(moe.router.dtype)
        if moe.shared_gate is not None:
            moe.shared_gate = moe.shared_gate * s.to(moe.shared_gate.dtype)
    quantized = [_quantize_expert(expert, s, stat.get(name), int8)
                 for expert, name in zip(experts, names, strict=True)]
    moe.experts = quantized[:len(moe.experts)]
    if moe.shared is not None:
        moe.shared = quantized[-1]


def _quantize_expert(expert: GatedMLP | ClampedSwiGLU, s: torch.Tensor | None, down_act: torch.Tensor | None,
                     int8: Int8Maker) -> GatedMLP | ClampedSwiGLU:
    """An expert whose input is smoothed by ``s`` (None: unsmoothed), its down projection smoothed from the
    inputs it saw (None: no calibration row reached it, or a gpt_oss expert)."""
    gate_up = expert.gate_up.weight.clone() if s is None else expert.gate_up.weight * s
    down = expert.down.weight
    if down_act is not None:
        down_s = smoothing_factors(down_act, down)
        gate_up[down.shape[1]:] /= down_s[:, None]
        down = down * down_s
    return replace(expert, gate_up=int8(gate_up, expert.gate_up.bias),
                   down=int8(down, expert.down.bias))


def _scaled_bias(bias: torch.Tensor | None, v_start: int, v_s: torch.Tensor) -> torch.Tensor | None:
    if bias is None:
        return None
    bias = bias.clone()
    bias[v_start:] = bias[v_start:] / v_s.reshape(-1)
    return bias
