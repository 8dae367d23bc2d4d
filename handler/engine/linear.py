"""The two kinds of Linear layer the model runs: dense, and int8 with per-call activation quantisation."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


class DenseLinear:
    """``y = x W^T + b`` with the weight kept in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8DynamicLinear:
    """Per-channel int8 weights with int8 activations quantised per call (fbgemm); fp32 in and out. CPU only.

    fbgemm picks one activation scale for the whole input tensor, which would let one row's values change its
    batch neighbours' rounding (measured: a logit moved by 5.9 when a prompt's prefix was computed alone instead
    of inside the whole prompt). So each row is mapped affinely onto [-1, 1]: ``x = c + s * x'``, hence
    ``W x = s * (W x') + c * rowsum(W)``, and one constant sentinel row holding exactly -1 and 1 pins the tensor's
    range. Every row then quantises with the same parameters whatever else is in the batch (the integer GEMM is
    exact), so a row's result does not depend on its neighbours, and each row gets its own full range.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantised tensor creation is deprecated upstream but still shipped
            # the same int8 values as torch.quantize_per_channel, in a third of the time (start-up)
            int8 = torch.round(weight / scales[:, None]).clamp_(-128, 127).to(torch.int8)
            qweight = torch._make_per_channel_quantized_tensor(int8, scales.double(), zero_points, 0)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        # rowsum of the weights as the kernel sees them (dequantised), so the centre term matches exactly
        self.row_sums = qweight.dequantize().sum(dim=1)  # [out]
        self.bias = None if bias is None else bias.float()
        self.sentinel = torch.zeros(weight.shape[1])
        self.sentinel[0], self.sentinel[-1] = -1.0, 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = _int8_linear(x, self.packed, self.row_sums, self.sentinel)
        return y if self.bias is None else y.add_(self.bias)


@torch.jit.script
def _int8_linear(x: torch.Tensor, packed: torch.classes.quantized.LinearPackedParamsBase, row_sums: torch.Tensor,
                 sentinel: torch.Tensor) -> torch.Tensor:
    """The per-call work of ``Int8DynamicLinear``, scripted: a dozen small ops per call cost ~130 us of Python
    dispatch at batch 1 (more than the GEMM itself); TorchScript runs them for a quarter of that."""
    rows = x.shape[0]
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)  # [rows, 1]
    centre = (high + low) * 0.5
    half_range = ((high - low) * 0.5).clamp(min=1e-6)
    scaled = torch.empty(rows + 1, x.shape[1], dtype=x.dtype)
    torch.sub(x, centre, out=scaled[:rows])
    scaled[:rows].div_(half_range).clamp_(-1.0, 1.0)
    scaled[rows].copy_(sentinel)
    # reduce_range: 7-bit activations avoid int16 saturation in AVX2 kernels (no VNNI on this CPU)
    y = torch.ops.quantized.linear_dynamic(scaled, packed, True)[:rows]
    return torch.addcmul(y * half_range, centre, row_sums)
