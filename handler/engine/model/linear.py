"""The two kinds of Linear layer the model runs: dense, and int8 with per-call activation quantisation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from handler.engine.model.kernels import GROUP, NORM_WIDTHS, cpu_flags, fused_silu_mul, int8_kernel

# Inputs per activation block: each row's activations are quantised to 16-bit codes per block of this many, with one
# scale per block (``Int8DynamicLinear``). Measured with bench.quality against fp32 (docs/development.md, "Numerics").
ACTIVATION_BLOCK = 128
CODE_MAX = 32767.0  # int8_linear.c's CODE_MAX: activation codes lie in [-CODE_MAX, CODE_MAX]
MAX_BLOCK = 512  # int8_linear.c's MAX_BLOCK: a block's int32 sums stay exact (512 * 32767 * 127 < 2^31)


class DenseLinear:
    """``y = x W^T + b`` with the weight kept in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8DynamicLinear:
    """Per-channel int8 weights in [-127, 127]; each row's activations quantised symmetrically to 16-bit integer codes
    in [-32767, 32767] per block of ``block`` inputs (one scale per block, ``max|x| / 32767``), multiplied in one
    integer pass; fp32 in and out. CPU only.

    Why a row's answer depends on nothing but the row, on any x86 CPU: each block's integer sum is exact however a
    kernel sums it (AVX2's vpmaddwd and AVX-512 VNNI's vpdpwssd multiply 16-bit pairs into int32 without rounding or
    saturating, and a block's sum stays below 2^31: ``MAX_BLOCK``), and the float steps after it (each block's scale
    times its sum, added block by block; times the channel's scale; the bias; the residual) are fixed IEEE
    operations per (row, channel), the same in our C kernel (``kernels/int8_linear.c``, every row count) and in
    ``reference_linear`` (torch ops, where the kernel cannot run).

    Why 16-bit codes rather than 8: the activations then cost nothing measurable beyond the int8 weights' own
    rounding, so answers that hang on a near-tie do not turn on the last bits of the float kernels around the layer
    (attention, norms), which differ between CPUs (docs/development.md, "Numerics"); and on AVX2 a 16-bit pair product
    is one instruction where a signed 8-bit one takes three.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, block: int | None = None) -> None:
        """``block``: inputs per activation block (``ACTIVATION_BLOCK`` when None)."""
        self._setup(*_quantise_weight(weight), bias, block)

    @classmethod
    def from_int8(cls, int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                  block: int | None = None) -> Int8DynamicLinear:
        """The layer of weights already quantised (``int8_weight``'s pair)."""
        layer = cls.__new__(cls)
        layer._setup(int8, scales, bias, block)
        return layer

    @classmethod
    def from_packed(cls, packed: torch.Tensor, in_features: int, scales: torch.Tensor, bias: torch.Tensor | None,
                    block: int | None = None) -> Int8DynamicLinear:
        """The layer of weights already packed (``packed``'s tensor, as ``model.packed`` keeps it)."""
        layer = cls.__new__(cls)
        layer._setup_packed(packed, in_features, scales, bias, block)
        return layer

    def _setup(self, int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, block: int | None) -> None:
        self._setup_packed(pack(int8), int8.shape[1], scales, bias, block)

    def _setup_packed(self, packed: torch.Tensor, in_features: int, scales: torch.Tensor, bias: torch.Tensor | None,
                      block: int | None) -> None:
        self.block = block or ACTIVATION_BLOCK
        if self.block % 2 or not 0 < self.block <= MAX_BLOCK:
            raise ValueError(f"an activation block is an even number of inputs up to {MAX_BLOCK}, not {self.block}")
        self.packed, self.in_features = packed, in_features
        self.out_features = scales.shape[0]
        self.scales = scales.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.kernel = int8_kernel() if packed.device.type == "cpu" else None
        self._kernel_call = None if self.kernel is None else self.kernel.bind(
            self.packed, self.in_features, self.scales, self.bias, self.block)
        self._mlp: tuple[Int8DynamicLinear, object] | None = None  # ``fused_mlp``'s down layer and bound call

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weights ``[out, in]`` and their fp32 per-channel scales."""
        return unpack(self.packed, self.out_features, self.in_features), self.scales

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None,
              norm: tuple[torch.Tensor, float, int] | None = None) -> torch.Tensor | None:
        """``residual + self(rms_norm(x, weight, eps))`` in one kernel call (each part where given; ``norm``:
        ``(weight, eps, lanes)``, the norm ``kernels.fused_rms_norm`` computes with those lanes), the same bits as the
        ops one by one; None where the kernel does not take these rows (the caller runs the ops)."""
        if self.kernel is None or x.shape[0] == 0 or x.dtype is not torch.float32 or x.dim() != 2:
            return None
        if residual is not None and not (residual.dtype is torch.float32 and residual.is_contiguous()
                                         and residual.shape == (x.shape[0], self.out_features)):
            return None
        if norm is not None and not (norm[0].dtype is torch.float32 and norm[0].is_contiguous()
                                     and norm[0].shape == (x.shape[1],) and x.shape[1] in NORM_WIDTHS):
            return None
        return self._kernel_call(x, residual, norm)

    def fused_mlp(self, down: Int8DynamicLinear, x: torch.Tensor, residual: torch.Tensor | None = None,
                  norm: tuple[torch.Tensor, float, int] | None = None) -> torch.Tensor | None:
        """A gated MLP whose gate_up is this layer: ``residual + down(silu(gate) * up)`` of ``self(rms_norm(x))``
        in one kernel call (``residual`` and ``norm`` as ``fused``'s), SiLU as ``kernels.fused_silu_mul`` computes
        it: the same bits as the calls one by one; None where the kernel does not take it."""
        silu = fused_silu_mul()
        if (silu is None or self.kernel is None or down.kernel is not self.kernel or down.block != self.block
                or 2 * down.in_features != self.out_features or x.shape[0] == 0 or x.dtype is not torch.float32
                or x.dim() != 2):
            return None
        if residual is not None and not (residual.dtype is torch.float32 and residual.is_contiguous()
                                         and residual.shape == (x.shape[0], down.out_features)):
            return None
        if norm is not None and not (norm[0].dtype is torch.float32 and norm[0].is_contiguous()
                                     and norm[0].shape == (x.shape[1],) and x.shape[1] in NORM_WIDTHS):
            return None
        if self._mlp is None or self._mlp[0] is not down:
            self._mlp = (down, self.kernel.bind_mlp((self.packed, self.scales, self.bias),
                                                    (down.packed, down.scales, down.bias), self.block, silu.lanes))
        return self._mlp[1](x, residual, norm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        if self._kernel_call is not None and x.dtype is torch.float32:
            return self._kernel_call(x)
        return reference_linear(x.float(), *self.int8_weight(), self.bias, self.block)


def _quantise_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: int8 values in [-127, 127] (round half to even) and fp32 scales ``max|w| / 127``."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
    return torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales


def pack(int8: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` int8 weights as the kernel reads them: groups of ``GROUP`` output channels, each group's inputs
    in steps of 2, ``[groups, in2 / 2, GROUP, 2]`` (zero-padded to whole groups and steps)."""
    out_features, in_features = int8.shape
    groups, in2 = -(-out_features // GROUP), -(-in_features // 2) * 2
    padded = int8
    if (groups * GROUP, in2) != (out_features, in_features):
        padded = int8.new_zeros(groups * GROUP, in2)
        padded[:out_features, :in_features] = int8
    return padded.view(groups, GROUP, in2 // 2, 2).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """``pack``'s inverse: the ``[out, in]`` int8 weights."""
    groups, steps = packed.shape[:2]
    return packed.transpose(1, 2).reshape(groups * GROUP, steps * 2)[:out_features, :in_features].contiguous()


def quantise_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, k]`` fp32 as the kernel quantises it: codes ``[rows, blocks * block]`` (int16 in
    [-CODE_MAX, CODE_MAX], zero past k) and each block's scale ``[rows, blocks]`` (``max|x| / CODE_MAX``; a code is
    ``round(x * (1 / scale))``, half to even, 0 where the scale is 0)."""
    rows, k = x.shape
    blocks = -(-k // block)
    padded = F.pad(x, (0, blocks * block - k)).view(rows, blocks, block)
    scale = padded.abs().amax(dim=-1) / CODE_MAX  # [rows, blocks]
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(padded * inverse[..., None]).clamp_(-CODE_MAX, CODE_MAX).to(torch.int16)
    return codes.view(rows, blocks * block), scale


def reference_linear(x: torch.Tensor, int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                     block: int) -> torch.Tensor:
    """The int8 Linear in torch ops, the kernel's bits (``kernels/int8_linear.c``): each block's integer sums, exact
    in float64 (every partial sum an integer below 2^53: ``MAX_BLOCK``), then the same float steps in the same
    order. Where the kernel cannot run, and the tests' reference."""
    rows, k = x.shape
    codes, block_scales = quantise_activations(x, block)
    acc = torch.zeros(rows, int8.shape[0])
    for b in range(block_scales.shape[1]):
        weight = int8[:, b * block:(b + 1) * block].double()
        sums = codes[:, b * block:b * block + weight.shape[1]].double() @ weight.T  # [rows, out], exact
        acc = acc + block_scales[:, b:b + 1] * sums.float()
    y = acc * scales
    return y if bias is None else y + bias


def describe_cpu() -> str:
    """One line for the start-up log: the CPU features that decide the int8 kernel, and the path chosen."""
    flags = cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8") if f in flags]
    kernel = int8_kernel()
    path = ("torch's int8 GEMM per block (no kernel: slow)" if kernel is None else
            f"our {'AVX-512 VNNI' if kernel.vnni else 'AVX2'} kernel")
    return (f"cpu: {' '.join(isa) or 'no AVX2'} (torch dispatch {torch.backends.cpu.get_cpu_capability()}); int8: "
            f"16-bit activations per block of {ACTIVATION_BLOCK} (the same integers on every CPU), {path}")
