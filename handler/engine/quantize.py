"""Int8 for CPU: SmoothQuant-style smoothing, calibrated at load on a fixed text, then dynamic int8 Linear layers.

Activations of a transformer have a few input channels far larger than the rest; quantising such a row to int8
rounds the ordinary channels away. SmoothQuant (Xiao et al., 2023) divides each input channel ``j`` by
``s_j = max|x_j|^a / max|W_j|^(1-a)`` and multiplies the weight's column ``j`` by the same ``s_j``: the product is
unchanged, but the activation becomes easy to quantise. The division is folded into what produces the activation,
so it costs nothing at run time: the RMSNorm weight before q/k/v and gate/up, the value projection before the
output projection (attention is linear in V), and the up projection before the down projection. A post-norm
block (olmo2) has no norm before q/k/v or gate/up (they read the residual stream itself), so those two stay
unsmoothed there (quantised as they are); q/k norms (qwen3, olmo2) act on the projection's output, which input
smoothing leaves unchanged.

``max|x_j|`` comes from one dense forward over ``CALIBRATION_TEXT`` at load (about 0.1 s for the embedded model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from handler.engine.linear import DenseLinear, Int8DynamicLinear

if TYPE_CHECKING:
    from handler.engine.model import DecoderModel

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
    """A dense Linear that remembers the largest |x| seen per input channel."""

    def __init__(self, linear: DenseLinear) -> None:
        self.linear = linear
        self.max_abs = torch.zeros(linear.weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.max_abs = torch.maximum(self.max_abs, x.detach().abs().amax(dim=0).float())
        return self.linear(x)


def calibrate(model: DecoderModel, token_ids: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per layer, ``max|x_j|`` of the inputs of qkv, out, gate_up and down over one dense forward."""
    from handler.engine.model import build_layout

    names = ("qkv", "out", "gate_up", "down")
    for layer in model.layers:
        for name in names:
            setattr(layer, name, _Recorder(getattr(layer, name)))
    cache = model.new_cache(1, len(token_ids))
    cache.ensure(1, len(token_ids))
    groups = model.shape.num_heads // model.shape.num_kv_heads
    positions = torch.arange(len(token_ids), device=model.device)
    layout = build_layout([], [(0, 0, len(token_ids))], groups, model.device)
    model.forward(torch.tensor(token_ids, device=model.device), positions, layout, cache,
                  torch.tensor([len(token_ids) - 1], device=model.device))
    stats = []
    for layer in model.layers:
        stats.append({name: getattr(layer, name).max_abs for name in names})
        for name in names:
            setattr(layer, name, getattr(layer, name).linear)
    return stats


def smoothing_factors(act_max: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``s_j`` for one Linear (weight ``[out, in]``), clamped away from zero."""
    weight_max = weight.abs().amax(dim=0).clamp(min=1e-5)
    return (act_max.clamp(min=1e-5).pow(ALPHA) / weight_max.pow(1 - ALPHA)).clamp(min=1e-2, max=1e2)


def smooth_and_quantize(model: DecoderModel, stats: list[dict[str, torch.Tensor]]) -> None:
    """Fold smoothing into the producers, then replace every Linear (and the LM head) with int8."""
    shape = model.shape
    v_start = (shape.num_heads + shape.num_kv_heads) * shape.head_dim
    groups = shape.num_heads // shape.num_kv_heads
    for layer, stat in zip(model.layers, stats, strict=True):
        qkv, gate_up = layer.qkv.weight.clone(), layer.gate_up.weight.clone()  # updated in place below
        if layer.input_norm is not None:
            s = smoothing_factors(stat["qkv"], qkv)
            layer.input_norm = layer.input_norm / s
            qkv.mul_(s)
        if layer.post_norm is not None:
            s = smoothing_factors(stat["gate_up"], gate_up)
            layer.post_norm = layer.post_norm / s
            gate_up.mul_(s)
        # The output projection's input channel h*head_dim+d comes from KV head h // groups, dim d.
        out_s = smoothing_factors(stat["out"], layer.out.weight).view(shape.num_kv_heads, groups, shape.head_dim)
        v_s = out_s.amax(dim=1)  # heads sharing a KV head must share its factor: [kv_heads, head_dim]
        out_s = v_s[:, None, :].expand_as(out_s).reshape(-1)
        qkv[v_start:] = qkv[v_start:] / v_s.reshape(-1, 1)
        out = layer.out.weight * out_s
        intermediate = layer.down.weight.shape[1]
        s = smoothing_factors(stat["down"], layer.down.weight)
        gate_up[intermediate:] = gate_up[intermediate:] / s[:, None]  # up rows: silu(gate) * up is linear in up
        down = layer.down.weight * s
        layer.qkv = Int8DynamicLinear(qkv, _scaled_bias(layer.qkv.bias, v_start, v_s))
        layer.out = Int8DynamicLinear(out, layer.out.bias)
        layer.gate_up = Int8DynamicLinear(gate_up, None)
        layer.down = Int8DynamicLinear(down, None)
    model.lm_head = Int8DynamicLinear(model.lm_head.weight, None)


def _scaled_bias(bias: torch.Tensor | None, v_start: int, v_s: torch.Tensor) -> torch.Tensor | None:
    if bias is None:
        return None
    bias = bias.clone()
    bias[v_start:] = bias[v_start:] / v_s.reshape(-1)
    return bias
