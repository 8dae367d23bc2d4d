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

    fbgemm picks one activation scale for the whole input tensor, which would let one row's outliers change its
    batch neighbours' rounding. So each row is first mapped affinely onto exactly [-1, 1]:
    ``x = c + s * x'``, hence ``W x = s * (W x') + c * rowsum(W)``. Every row then quantises with the same
    parameters whatever else is in the batch (the integer GEMM is exact), and each row gets its own full range.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantised tensor creation is deprecated upstream but still shipped
            qweight = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        # rowsum of the weights as the kernel sees them (dequantised), so the centre term matches exactly
        self.row_sums = qweight.dequantize().sum(dim=1)  # [out]
        self.bias = None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        low, high = torch.aminmax(x, dim=-1, keepdim=True)  # [rows, 1]
        centre, half_range = (high + low) * 0.5, ((high - low) * 0.5).clamp(min=1e-6)
        # reduce_range: 7-bit activations avoid int16 saturation in AVX2 kernels (no VNNI on this CPU)
        y = torch.ops.quantized.linear_dynamic((x - centre) / half_range, self.packed, True)
        y = torch.addcmul(y * half_range, centre, self.row_sums)
        return y if self.bias is None else y + self.bias
