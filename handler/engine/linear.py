"""The two kinds of Linear layer the model runs: dense, and int8 with per-call activation quantisation."""

from __future__ import annotations

import os
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
    """Per-channel int8 weights, activations quantised per row onto an exact grid (fbgemm's integer GEMM); fp32 in
    and out. CPU only.

    Why a row cannot depend on its neighbours, on any x86 kernel: each row is mapped affinely onto the integers
    ``k`` in ``-G..G-1`` (``G = levels / 2``), so ``x ~ c + s * k`` with per-row ``c`` and ``s``, hence
    ``W x = s * (W k) + c * rowsum(W)``. ``k`` is already rounded here, by elementwise torch ops, and a constant
    sentinel row holding ``-G`` and ``G - 1`` makes fbgemm choose exactly scale 1 and zero point ``G`` for the
    whole tensor. Quantising an integer with scale 1 is exact however the kernel does it (multiply by the inverse
    or divide, vector body or scalar tail), the integer GEMM is exact (integer sums do not depend on blocking),
    and the float epilogue is elementwise. The previous design left the rounding to fbgemm.

    ``levels`` is 128 (7-bit activations, ``reduce_range``) where pairs of u8*s8 products are summed into int16
    (AVX2 without VNNI: 255*128*2 would saturate) and 256 where the kernel is proven exact at load
    (``activation_levels``: VNNI / AMX machines).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.levels = activation_levels()
        self.packed, self.row_sums = _pack(weight)
        self.bias = None if bias is None else bias.float()
        self.sentinel = torch.zeros(weight.shape[1])
        self.sentinel[0], self.sentinel[-1] = -(self.levels // 2), self.levels // 2 - 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = _int8_linear(x, self.packed, self.row_sums, self.sentinel, self.levels)
        return y if self.bias is None else y.add_(self.bias)


def _pack(weight: torch.Tensor) -> tuple[torch.classes.quantized.LinearPackedParamsBase, torch.Tensor]:
    """fbgemm's packed per-channel int8 weight, and its row sums as the kernel sees them (dequantised), so the
    centre term ``c * rowsum(W)`` matches the integer product exactly."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantised tensor creation is deprecated upstream but still shipped
        # the same int8 values as torch.quantize_per_channel, in a third of the time (start-up)
        int8 = torch.round(weight / scales[:, None]).clamp_(-128, 127).to(torch.int8)
        qweight = torch._make_per_channel_quantized_tensor(int8, scales.double(), zero_points, 0)
        packed = torch.ops.quantized.linear_prepack(qweight, None)
    return packed, qweight.dequantize().sum(dim=1)


@torch.jit.script
def _int8_linear(x: torch.Tensor, packed: torch.classes.quantized.LinearPackedParamsBase, row_sums: torch.Tensor,
                 sentinel: torch.Tensor, levels: int) -> torch.Tensor:
    """The per-call work of ``Int8DynamicLinear``, scripted: a dozen small ops per call cost ~130 us of Python
    dispatch at batch 1 (more than the GEMM itself); TorchScript runs them for a quarter of that."""
    rows = x.shape[0]
    grid = float(levels // 2)
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)  # [rows, 1] (aminmax: 10x slower)
    step = (high - low).mul_(1.0 / (levels - 1)).clamp_(min=1e-9)
    centre = low.add_(step * grid)  # x = centre + step * k, k = q - G an integer in -G..G-1
    scaled = torch.empty(rows + 1, x.shape[1], dtype=x.dtype)
    torch.sub(x, centre, out=scaled[:rows])
    # k = round((x - centre) / step) (the extremes land on -G and G-1): an integer, so with scale 1 every kernel
    # quantises it back to q = k + G exactly
    scaled[:rows].div_(step).round_()
    scaled[rows].copy_(sentinel)
    y = torch.ops.quantized.linear_dynamic(scaled, packed, levels == 128)[:rows]
    return y.mul_(step).addcmul_(centre, row_sums)  # x = centre + step * k


_LEVELS: int | None = None


def activation_levels() -> int:
    """256 when fbgemm's full-range u8*s8 GEMM is exact on this CPU (checked once on the worst case: every
    activation 255 against weights of -128 and 127), else 128. ``LLM_INT8_ACTIVATION_BITS=7`` forces 128."""
    global _LEVELS
    if _LEVELS is None:
        _LEVELS = 128 if os.environ.get("LLM_INT8_ACTIVATION_BITS") == "7" or not _full_range_is_exact() else 256
    return _LEVELS


def _full_range_is_exact() -> bool:
    k = 256
    weight = torch.full((16, k), 1.0)
    weight[8:] = -128.0 / 127.0  # per-channel scale 1/127: int8 weights 127 and -128
    packed, _ = _pack(weight)
    expected = torch.tensor([255.0 * 127.0 * (k - 1), -255.0 * 128.0 * (k - 1)]) / (255.0 * 127.0)
    for rows in (1, 5, 64):  # kernels may differ by batch size
        x = torch.ones(rows, k)
        x[:, 0] = 0.0  # range [0, 1]: scale 1/255, every other activation quantises to 255
        y = torch.ops.quantized.linear_dynamic(x, packed, False)
        if not torch.allclose(y[:, [0, 8]], expected.expand(rows, 2), rtol=1e-6, atol=0.0):
            return False
    return True


def describe_cpu() -> str:
    """One line for the start-up log: the CPU features that decide the int8 kernel, and the path chosen."""
    flags = _cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8") if f in flags]
    levels = activation_levels()
    return (f"cpu: {' '.join(isa) or 'no AVX2'} (torch dispatch {torch.backends.cpu.get_cpu_capability()}); int8: "
            f"fbgemm u8*s8->s32, {'8' if levels == 256 else '7'}-bit per-row activations on an exact grid")


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo", encoding="ascii", errors="replace"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
