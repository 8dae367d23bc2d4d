"""The two kinds of Linear layer the model runs: dense, and int8 with per-call activation quantisation."""

from __future__ import annotations

import os
import threading
import warnings
import weakref

import torch
import torch.nn.functional as F

from handler.config import INT8_SITES
from handler.engine.model.kernels import KERNEL_ROWS, NORM_WIDTHS, cpu_flags, int8_kernel


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
    and the float epilogue is elementwise.

    ``levels`` is 128 (7-bit activations, ``reduce_range``) where pairs of u8*s8 products are summed into int16
    (AVX2 without VNNI: 255*128*2 would saturate) and 256 where the kernel is proven exact at load
    (``activation_levels``: VNNI / AMX machines).

    ``split``: 14-bit activations on every CPU (every layer by default: ``quantize.SPLIT``). Each row's ``k`` lies in
    ``-8256..8127`` and is written as ``128 * h + l`` with both halves in ``-64..63``; the halves go through one
    7-bit GEMM as extra rows (the weights are read once) and are recombined elementwise, so the same integers are
    multiplied on an AVX2 and a VNNI machine.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, split: bool = False,
                 levels: int | None = None) -> None:
        """``levels``: 128 or 256, this CPU's (``activation_levels``) when None."""
        self._setup(*_quantise_weight(weight), bias, split, levels)

    @classmethod
    def from_int8(cls, int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, split: bool = False,
                  levels: int | None = None,
                  sums: tuple[torch.Tensor, torch.Tensor] | None = None) -> Int8DynamicLinear:
        """The layer of weights already quantised (``int8_weight``'s pair, as ``packed`` keeps them); ``sums``:
        its ``(row_sums, col_sums)`` as an earlier layer of the same weights computed them (``sums``)."""
        layer = cls.__new__(cls)
        layer._setup(int8, scales, bias, split, levels, sums)
        return layer

    def _setup(self, int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, split: bool,
               levels: int | None, sums: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.split = split
        self.levels = 128 if split else levels or activation_levels()
        self.row_sums = _row_sums(int8, scales) if sums is None else sums[0]
        # the split path's few-row kernel (``kernels``) reads the int8 weights as they are, with their scales
        self.kernel = int8_kernel() if split and int8.device.type == "cpu" else None
        self._packed = None
        self._pack_lock = threading.Lock()
        self.bias = None if bias is None else bias.float()
        if self.kernel is not None:
            self.int8, self.scales = int8, scales.double().float()
            self.col_sums = int8.sum(dim=1, dtype=torch.int32) if sums is None else sums[1]
            # fbgemm's packing waits (``packed``, ``pack_one``): it was a third of a start's load, and only batches of
            # FBGEMM_ROWS or more need it (fewer take the kernel in blocks of its rows, with the same bits)
            with _DEFERRED_LOCK:
                _DEFERRED.add(self)
            self._kernel_rows = self.kernel.bind(self.int8, self.col_sums, self.scales, self.row_sums, self.bias)
        else:
            self._packed = _prepack(int8, scales)
        self.sentinel = torch.zeros(int8.shape[1])
        self.sentinel[0], self.sentinel[-1] = -(self.levels // 2), self.levels // 2 - 1
        # 8-bit activations asked for on a CPU whose kernel would saturate them: the same numbers, computed exactly
        # from the int8 weights in float64 (``_exact_int8_linear``), slowly
        self.exact = (int8.double().T.contiguous(), scales.double().float()) if (
            self.levels == 256 and not full_range_is_exact()) else None

    def sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``from_int8`` would compute again from the int8 weights: the dequantised row sums fbgemm's centre
        term uses, and the int8 sums the kernel's offset uses (``packed.save`` keeps them: a start is spared
        computing them)."""
        col_sums = self.col_sums if self.kernel is not None else self.int8_weight()[0].sum(dim=1, dtype=torch.int32)
        return self.row_sums, col_sums

    @property
    def packed(self) -> torch.classes.quantized.LinearPackedParamsBase:
        """fbgemm's packed weight (packed on first use where the kernel let it wait)."""
        if self._packed is None:
            with self._pack_lock:
                if self._packed is None:
                    self._packed = _prepack(self.int8, self.scales)
        return self._packed

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weights ``[out, in]`` and their fp32 per-channel scales."""
        if self.kernel is not None:
            return self.int8, self.scales
        weight, _bias = torch.ops.quantized.linear_unpack(self.packed)
        return weight.int_repr(), weight.q_per_channel_scales().float()

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None,
              norm: tuple[torch.Tensor, float, int] | None = None) -> torch.Tensor | None:
        """``residual + self(rms_norm(x, weight, eps))`` in one kernel call (each part where given; ``norm``:
        ``(weight, eps, lanes)``, the norm ``kernels.fused_rms_norm`` computes with those lanes), the same bits as the
        ops one by one; None where the kernel does not take these rows (the caller runs the ops)."""
        if self.kernel is None or not 0 < x.shape[0] <= KERNEL_ROWS or x.dtype is not torch.float32 or x.dim() != 2:
            return None
        if residual is not None and not (residual.dtype is torch.float32 and residual.is_contiguous()
                                         and residual.shape == (x.shape[0], self.int8.shape[0])):
            return None
        if norm is not None and not (norm[0].dtype is torch.float32 and norm[0].is_contiguous()
                                     and norm[0].shape == (x.shape[1],) and x.shape[1] in NORM_WIDTHS):
            return None
        return self._kernel_rows(x, residual, norm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.shape[0] < FBGEMM_ROWS:
            if x.shape[0] <= KERNEL_ROWS:
                return self._kernel_rows(x)
            return torch.cat([self._kernel_rows(x[i:i + KERNEL_ROWS]) for i in range(0, x.shape[0], KERNEL_ROWS)])
        if self.split:
            y = _split_int8_linear(x, self.packed, self.row_sums, self.sentinel)
        elif self.exact is not None:
            y = _exact_int8_linear(x, *self.exact, self.row_sums)
        else:
            y = _int8_linear(x, self.packed, self.row_sums, self.sentinel, self.levels)
        return y if self.bias is None else y.add_(self.bias)


def _quantise_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: int8 values (round to nearest) and fp32 scales ``max|w| / 127``."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
    # the same int8 values as torch.quantize_per_channel, in a third of the time (start-up)
    return torch.round(weight / scales[:, None]).clamp_(-128, 127).to(torch.int8), scales


# From this many rows a kernel layer takes fbgemm's GEMM (packing it first where it waits, ~7 ms for one of the
# embedded model's Linears, 0.25 s for its head); below, the kernel 8 rows at a time, which reads the weights once per
# 8 rows and still beat fbgemm (the same bits either way). Measured here (Intel, AVX-512 VNNI, 2 threads), the
# embedded model's whole step, kernel against fbgemm: decode batches of 16 rows 41.3 / 49.9 ms, 24: 60.6 / 63.8,
# 32: 83.6 / 79.7; prefill chunks of 15 rows 34 / 45 ms, 30: 63 / 59, 60: 124 / 103.
FBGEMM_ROWS = 32
# kernel layers whose fbgemm packing waits, until ``pack_one`` packs them
_DEFERRED: weakref.WeakSet = weakref.WeakSet()
_DEFERRED_LOCK = threading.Lock()


def pack_one() -> bool:
    """Pack one kernel layer whose fbgemm packing waits (the lean engine's packing thread calls it while the engine
    is idle; fbgemm's packing releases the GIL); whether there was one."""
    with _DEFERRED_LOCK:
        layer = _DEFERRED.pop() if _DEFERRED else None
    if layer is None:
        return False
    layer.packed  # noqa: B018 (packs it)
    return True


def _pack(weight: torch.Tensor) -> tuple[torch.classes.quantized.LinearPackedParamsBase, torch.Tensor]:
    """fbgemm's packed per-channel int8 weight, and its row sums as the kernel sees them (dequantised), so the
    centre term ``c * rowsum(W)`` matches the integer product exactly."""
    int8, scales = _quantise_weight(weight)
    return _prepack(int8, scales), _row_sums(int8, scales)


def _quantised(int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weights as torch's per-channel quantised tensor (what fbgemm packs)."""
    zero_points = torch.zeros(int8.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantised tensor creation is deprecated upstream but still shipped
        return torch._make_per_channel_quantized_tensor(int8, scales.double(), zero_points, 0)


def _prepack(int8: torch.Tensor, scales: torch.Tensor) -> torch.classes.quantized.LinearPackedParamsBase:
    """fbgemm's packed form of weights already quantised."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ops.quantized.linear_prepack(_quantised(int8, scales), None)


def _row_sums(int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each output channel's dequantised weights summed, as fbgemm's weights are (``_pack``)."""
    return _quantised(int8, scales).dequantize().sum(dim=1)


def _exact_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weight as float64 ``[in, out]`` and its scales as fbgemm applies them (fp32)."""
    int8, scales = _quantise_weight(weight)
    return int8.double().T.contiguous(), scales.double().float()


def _activation_grid(x: torch.Tensor, levels: int, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row ``step`` and ``centre``: ``x`` spans ``centre + step * k`` for ``k`` in ``-offset..levels-1-offset``."""
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)  # [rows, 1] (aminmax: 10x slower)
    step = (high - low).mul_(1.0 / (levels - 1)).clamp_(min=1e-9)
    return step, low.add_(step * offset)


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


@torch.jit.script
def _split_int8_linear(x: torch.Tensor, packed: torch.classes.quantized.LinearPackedParamsBase,
                       row_sums: torch.Tensor, sentinel: torch.Tensor) -> torch.Tensor:
    """``_int8_linear`` with 14-bit activations as two 7-bit halves (``Int8DynamicLinear.split``): the rows of
    ``h`` then of ``l`` then the 7-bit sentinel go through one GEMM; ``W k = 128 * (W h) + W l``, each product
    exact in int32 and its float within one rounding, recombined per element."""
    rows = x.shape[0]
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    step = (high - low).mul_(1.0 / 16383.0).clamp_(min=1e-9)
    centre = low.add_(step * 8256.0)  # k in -8256..8127
    stacked = torch.empty(2 * rows + 1, x.shape[1], dtype=x.dtype)
    shifted = torch.sub(x, centre, out=stacked[rows:2 * rows]).div_(step).round_().add_(64.0)  # k + 64
    high_half = torch.div(shifted, 128.0, rounding_mode="floor", out=stacked[:rows])  # h in -64..63
    shifted.sub_(high_half * 128.0).sub_(64.0)  # l = k - 128 h in -64..63, in place
    stacked[2 * rows].copy_(sentinel)
    y = torch.ops.quantized.linear_dynamic(stacked, packed, True)
    return y[:rows].mul_(128.0).add_(y[rows:2 * rows]).mul_(step).addcmul_(centre, row_sums)


def _exact_int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                       row_sums: torch.Tensor) -> torch.Tensor:
    """What fbgemm's full-range kernel returns on a VNNI machine (``float(W k) * scale``, ``W k`` exact), with the
    integer product taken in float64 (exact below 2^53): for ``LLM_INT8_ACTIVATION_BITS=8`` on a CPU whose kernel
    would saturate. Checked bit for bit against fbgemm wherever fbgemm is exact (``tests/unit/test_linear.py``)."""
    step, centre = _activation_grid(x, 256, 128.0)
    k = torch.sub(x, centre).div_(step).round_()
    y = (k.double() @ weight).float().mul_(scales)
    return y.mul_(step).addcmul_(centre, row_sums)


_LEVELS: int | None = None
_EXACT: bool | None = None


def activation_levels() -> int:
    """256 when fbgemm's full-range u8*s8 GEMM is exact on this CPU (checked once on the worst case: every
    activation 255 against weights of -128 and 127), else 128. ``LLM_INT8_ACTIVATION_BITS`` forces either: 7, or 8
    (computed exactly, slowly, where the kernel would saturate: tests prove the 8-bit path's answers on any CPU)."""
    global _LEVELS
    if _LEVELS is None:
        forced = os.environ.get("LLM_INT8_ACTIVATION_BITS")
        _LEVELS = {"7": 128, "8": 256}.get(forced or "", 256 if full_range_is_exact() else 128)
    return _LEVELS


def full_range_is_exact() -> bool:
    """Whether fbgemm's u8*s8 GEMM is exact on full-range activations here (no int16 pair saturation)."""
    global _EXACT
    if _EXACT is None:
        _EXACT = _full_range_is_exact()
    return _EXACT


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


def describe_cpu(split: frozenset[str] | None = None) -> str:
    """One line for the start-up log: the CPU features that decide the int8 kernel, the path chosen, and (given)
    the layers whose activations are split into 14 bits."""
    flags = cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8") if f in flags]
    levels = activation_levels()
    emulated = " (computed exactly in float64: this CPU's kernel would saturate them; slow)" if (
        levels == 256 and not full_range_is_exact()) else ""
    head = (f"cpu: {' '.join(isa) or 'no AVX2'} (torch dispatch {torch.backends.cpu.get_cpu_capability()}); int8: "
            "fbgemm u8*s8->s32, ")
    row_bits = f"{'8' if levels == 256 else '7'}-bit per-row activations on an exact grid{emulated}"
    found = int8_kernel() if split else None
    kernel = (f"; split layers take up to {KERNEL_ROWS} rows through our "
              f"{'AVX-512 VNNI' if found.vnni else 'AVX2'} kernel" if found else "")
    if split is None:
        return head + row_bits
    if split >= set(INT8_SITES):
        return (head + "14-bit per-row activations (two 7-bit halves: the same integers on every CPU) in every layer"
                + kernel)
    return head + f"{row_bits}; 14-bit (two 7-bit halves) into: {', '.join(sorted(split)) or 'none'}{kernel}"
