"""The lean engine's own CPU kernels: the int8 Linear for any number of rows (``int8_linear.c``), RMSNorm in one call
(``rms_norm.c``, ``fused_rms_norm``), a layer's q/k/v split with RoPE (``rope.c``), a decode step's KV writes
(``kv_cache.c``), and a gated MLP's SiLU times up (``silu.c``, ``fused_silu_mul``); a step's attention
(``attention.c``) is bound by ``handler.engine.model.attention``.

Why our own: torch has no int8 GEMM that gives the same integers on every x86 CPU with 16-bit activations (fbgemm's
u8*s8 pairs saturate on AVX2), and at batch 1 a Linear as a dozen small torch ops cost more in dispatch than its
matrix product. The C kernel quantises the rows, reads the int8 weights once per call for all of them with AVX2's
16-bit pair products (AVX-512 VNNI's where the CPU has them: the same exact integers), and applies a fixed float
epilogue, giving the bits of its torch reference (``linear.reference_linear``; ``tests/unit/test_int8_kernel.py``),
so a row's answer does not depend on which path ran.

It is plain C, built with the system compiler in about a second (no torch headers; ``build``) into a cache keyed by
its source and flags, and loaded with ctypes: ``make model`` and the image build it ahead; a start builds it if it is
missing. Without AVX2 and FMA, or a compiler, the torch reference runs (one log line says so); ``LLM_INT8_KERNEL=torch``
forces it, and ``LLM_INT8_KERNEL_ISA=avx2`` keeps the kernel's AVX2 sums on a CPU with AVX-512 VNNI.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from handler.engine.model.kernels.build import build
from handler.knobs import knob, path_knob

log = logging.getLogger(__name__)

GROUP = 16  # int8_linear.c's GROUP: output channels per packed group of weights (``linear.pack``)
SCRATCH_ALIGN = 64  # int8_linear.c: the bytes int8_scratch_bytes adds to align the codes


class Int8Kernel:
    """The loaded library: ``bind``'s int8 Linear for any number of rows, on torch's OpenMP threads."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        pointer, integer = ctypes.c_void_p, ctypes.c_int
        # no argtypes: ``bind`` passes its pointers as prebuilt c_void_p and its sizes as ints, so ctypes converts
        # nothing per call
        self.lib.int8_linear.restype = integer
        self.lib.int8_mlp.restype = integer
        self.lib.int8_scratch_bytes.argtypes = [integer, integer, integer]
        self.lib.int8_scratch_bytes.restype = ctypes.c_int64
        self.lib.rms_norm_rows.argtypes = [pointer, ctypes.c_int64, ctypes.c_int64, pointer, ctypes.c_float, integer,
                                           pointer]
        self.lib.rms_norm_rows.restype = integer
        self.lib.split_rotate_rows.argtypes = [pointer, ctypes.c_int64, integer, integer, integer, pointer, pointer,
                                               pointer]
        self.lib.split_rotate_rows.restype = None
        self.lib.silu_mul_rows.argtypes = [pointer, ctypes.c_int64, ctypes.c_int64, integer, pointer]
        self.lib.silu_mul_rows.restype = integer
        self.lib.silu_use_exp.argtypes = [pointer, pointer]
        self.lib.silu_use_exp.restype = None
        self.lib.kv_write_rows.argtypes = [pointer, pointer, ctypes.c_int64, ctypes.c_int64, integer, integer,
                                           ctypes.c_int64, ctypes.c_int64, pointer, pointer, ctypes.c_int64, pointer,
                                           ctypes.c_int64]
        self.lib.kv_write_rows.restype = integer
        self.lib.int8_use_vnni.argtypes = [integer]
        self.lib.int8_use_vnni.restype = integer
        # scratch shared by every call (one engine thread calls the model): the activations' codes, the normed rows
        # and the MLP's two intermediates (``_grow``)
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self.scratch_bytes, self._scratch = 0, ctypes.c_void_p(0)
        self.floats = {name: torch.empty(0) for name in ("normed", "gate_up", "gated")}
        self._floats = {name: ctypes.c_void_p(0) for name in self.floats}
        self.vnni = self.use_vnni(knob("LLM_INT8_KERNEL_ISA") != "avx2")

    def use_vnni(self, wanted: bool) -> bool:
        """Sum with AVX-512 VNNI where the CPU has it (``int8_linear.c``: the same integers, so the same bits), or
        with AVX2 (``LLM_INT8_KERNEL_ISA=avx2`` at start; tests switch both ways); whether VNNI is taken now."""
        self.vnni = bool(self.lib.int8_use_vnni(int(wanted)))
        return self.vnni

    def bind(self, packed: torch.Tensor, in_features: int, scales: torch.Tensor, bias: torch.Tensor | None,
             block: int) -> Callable[..., torch.Tensor]:
        """The int8 Linear of these weights (``linear.pack``'s layout, ``scales`` fp32 ``[out]``, ``bias`` fp32 or
        None; activation blocks of ``block`` inputs) as a function of ``x`` (``[rows, in]`` fp32, any rows): their
        pointers are made once, so a call costs ~3 us of Python and ctypes. The caller keeps the tensors alive and
        unchanged for as long as it calls it.

        The function also takes ``residual`` (``[rows, out]`` fp32 contiguous: ``residual + linear(x)``, as torch's
        add after it) and ``norm`` (``(weight, eps, lanes)``: ``linear(rms_norm(x))``, the norm as ``rms_norm.c``
        computes it with those lanes), each in the same call (``Int8DynamicLinear.fused``)."""
        n, k = scales.shape[0], in_features
        pointer = ctypes.c_void_p
        fixed = (pointer(packed.data_ptr()), pointer(scales.data_ptr()),
                 None if bias is None else pointer(bias.data_ptr()), n, block)
        call, empty, no_norm = self.lib.int8_linear, torch.empty, (None, ctypes.c_float(0.0), 0)
        per_row = self.lib.int8_scratch_bytes(1, k, block) - SCRATCH_ALIGN  # the codes and scales of a row

        def linear(x: torch.Tensor, residual: torch.Tensor | None = None,
                   norm: tuple[torch.Tensor, float, int] | None = None) -> torch.Tensor:
            x = x.contiguous()
            rows = x.shape[0]
            need = rows * per_row + SCRATCH_ALIGN
            if need > self.scratch_bytes or (norm is not None and rows * k > self.floats["normed"].numel()):
                self._grow(need, normed=0 if norm is None else rows * k)
            y = empty(rows, n)
            norm_args = no_norm if norm is None else (pointer(norm[0].data_ptr()), ctypes.c_float(norm[1]), norm[2])
            if call(pointer(x.data_ptr()), rows, k, *fixed, self._scratch, pointer(y.data_ptr()),
                    None if residual is None else pointer(residual.data_ptr()), *norm_args,
                    self._floats["normed"]) != 0:
                raise RuntimeError(f"int8 kernel refused {rows} rows of {k} inputs (block {block})")
            return y

        return linear

    def bind_mlp(self, gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
                 down: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], block: int,
                 silu_lanes: int) -> Callable[..., torch.Tensor]:
        """A gated MLP of two int8 Linears (each ``(packed, scales, bias)`` as ``bind`` takes them; gate_up's
        ``2 * inter`` channels gate first, down's ``hidden``) as a function of ``x`` ``[rows, hidden]``, with
        ``residual`` and ``norm`` as ``bind``'s: ``residual + down(silu(gate) * up)`` of ``gate_up(rms_norm(x))`` in
        one call (``int8_mlp``), SiLU as ``silu.c`` computes it on ``silu_lanes`` lanes: the bits of the calls one by
        one."""
        hidden, inter = down[1].shape[0], gate_up[1].shape[0] // 2
        pointer = ctypes.c_void_p

        def weights(layer: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> tuple:
            packed, scales, bias = layer
            return pointer(packed.data_ptr()), pointer(scales.data_ptr()), None if bias is None else pointer(
                bias.data_ptr())

        first, second = weights(gate_up), weights(down)
        call, empty, no_norm = self.lib.int8_mlp, torch.empty, (None, ctypes.c_float(0.0), 0)
        per_row = self.lib.int8_scratch_bytes(1, max(hidden, inter), block) - SCRATCH_ALIGN

        def mlp(x: torch.Tensor, residual: torch.Tensor | None = None,
                norm: tuple[torch.Tensor, float, int] | None = None) -> torch.Tensor:
            x = x.contiguous()
            rows = x.shape[0]
            need = rows * per_row + SCRATCH_ALIGN
            if need > self.scratch_bytes or rows * inter > self.floats["gated"].numel() or (
                    norm is not None and rows * hidden > self.floats["normed"].numel()):
                self._grow(need, normed=0 if norm is None else rows * hidden, gate_up=rows * 2 * inter,
                           gated=rows * inter)
            y = empty(rows, hidden)
            norm_args = no_norm if norm is None else (pointer(norm[0].data_ptr()), ctypes.c_float(norm[1]), norm[2])
            floats = self._floats
            if call(pointer(x.data_ptr()), rows, hidden, inter, *first, *second, block, self._scratch,
                    pointer(y.data_ptr()), None if residual is None else pointer(residual.data_ptr()), *norm_args,
                    floats["normed"], silu_lanes, floats["gate_up"], floats["gated"]) != 0:
                raise RuntimeError(f"int8 MLP kernel refused {rows} rows (block {block}, SiLU lanes {silu_lanes})")
            return y

        return mlp

    def _grow(self, scratch_bytes: int, **floats: int) -> None:
        """Room for a call's codes (``scratch_bytes``) and float rows (by name): grown, never shrunk."""
        if scratch_bytes > self.scratch_bytes:
            self.scratch = torch.empty(max(scratch_bytes, 2 * self.scratch_bytes), dtype=torch.uint8)
            self.scratch_bytes = self.scratch.numel()
            self._scratch = ctypes.c_void_p(self.scratch.data_ptr())
        for name, count in floats.items():
            if count > self.floats[name].numel():
                self.floats[name] = torch.empty(max(count, 2 * self.floats[name].numel()))
                self._floats[name] = ctypes.c_void_p(self.floats[name].data_ptr())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int) -> torch.Tensor:
        """``F.rms_norm(x, (n,), weight, eps)`` of fp32 contiguous ``x`` ``[rows, n]`` (``rms_norm.c``; ``lanes``:
        the width of torch's float vectors, whose sum order it follows)."""
        y = torch.empty_like(x)
        self.lib.rms_norm_rows(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, lanes, y.data_ptr())
        return y

    def split_rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qk_split.split_and_rotate``'s q, k and v, the same bits, in one call (``rope.c``): ``qkv`` ``[rows,
        (heads + 2 kv_heads) * head_dim]``, ``cos`` and ``sin`` ``rows * head_dim`` values, all fp32 contiguous."""
        rows = qkv.shape[0]
        out = torch.empty(rows, num_heads + 2 * num_kv_heads, head_dim)
        self.lib.split_rotate_rows(qkv.data_ptr(), rows, num_heads, num_kv_heads, head_dim, cos.data_ptr(),
                                   sin.data_ptr(), out.data_ptr())
        return out.split_with_sizes((num_heads, num_kv_heads, num_kv_heads), 1)

    def kv_write(self, keys: torch.Tensor, values: torch.Tensor, first: int, k: torch.Tensor, v: torch.Tensor,
                 positions: torch.Tensor) -> bool:
        """Row ``i`` of ``k`` and ``v`` (``[count, kv_heads, dim]``) into slot ``first + i`` of one layer's ``keys``
        and ``values`` (``[slots, kv_heads, capacity, dim]``) at ``positions[i]``, as plain copies (``kv_cache.c``).
        False, writing nothing, where the tensors are not laid out for it (fp32, contiguous heads); IndexError for a
        slot or position outside the cache, as torch's indexing."""
        count, heads, dim = k.shape
        if not (k.dtype is v.dtype is keys.dtype is torch.float32 and keys.is_contiguous() and values.is_contiguous()
                and k.stride()[1:] == v.stride()[1:] == (dim, 1) and positions.dtype is torch.int64
                and positions.is_contiguous() and v.shape == k.shape and positions.numel() == count):
            return False
        slots, _heads, capacity, _dim = keys.shape
        if self.lib.kv_write_rows(keys.data_ptr(), values.data_ptr(), slots, capacity, heads, dim, first, count,
                                  positions.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0)) != 0:
            raise IndexError(f"KV write outside the cache: slots {first}..{first + count - 1} of {slots}, positions "
                             f"{positions.tolist()} of {capacity}")
        return True


_KERNEL: Int8Kernel | None = None
_TRIED = False
_FIRST_USE = threading.Lock()  # layers are set up on several threads (``packed.load``)


def int8_kernel() -> Int8Kernel | None:
    """This process's kernel, built and loaded on first use; None where it cannot run (no AVX2, no compiler,
    ``LLM_INT8_KERNEL=torch``), with one log line saying why."""
    global _KERNEL, _TRIED
    with _FIRST_USE:
        if _TRIED:
            return _KERNEL
        _TRIED = True
        if knob("LLM_INT8_KERNEL") == "torch":
            return None
        if not {"avx2", "fma"} <= cpu_flags():
            log.info("int8: no AVX2 and FMA on this CPU; the int8 Linears run through torch's ops (the same numbers, "
                     "slowly)")
            return None
        try:
            _KERNEL = Int8Kernel(build(path_knob("LLM_KERNEL_CACHE")))
        except OSError as error:
            log.warning("int8: the kernel could not be built (%s); the int8 Linears run through torch's ops (the same "
                        "numbers, slowly)", error)
        return _KERNEL


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        for line in open("/proc/cpuinfo", encoding="ascii", errors="replace"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# rows this wide or wider: torch may split one row's sum between threads (its reductions split above 32768
# elements), which ``rms_norm.c`` does not follow; narrower than 16: torch sums them as scalars
NORM_WIDTHS = range(16, 32768)


@functools.cache
def fused_rms_norm():
    """``norm(x, weight, eps)``: torch's CPU ``rms_norm`` of fp32 rows, bit for bit, in one kernel call (the torch
    op where the kernel does not apply: another dtype or width, a non-contiguous row); None where the kernel
    cannot run or does not reproduce torch here. Decided once per process: the kernel's sums follow ATen's for a
    float vector of 8 or 16 lanes, and the width whose norms equal torch's own op on seeded random rows is taken.
    Which one torch runs is not told by its dispatch name: on an AVX-512 machine here (torch 2.13 dispatching
    "AVX512") its float sum ran 8 lanes, as under AVX2 (measured: 8 lanes matched at every width, 16 at few).
    Where neither width matches, torch's op runs (one log line)."""
    kernel = int8_kernel()
    if kernel is None:
        return None
    return _matching("RMSNorm", {lanes: _norm_of(kernel, lanes) for lanes in (8, 16)}, _norm_mismatch)


def _matching(name: str, candidates: dict, mismatch_of):
    """The first of ``candidates`` (by vector width) whose output equals torch's here (``mismatch_of`` is None),
    else None, with one log line naming where each differed."""
    mismatches = []
    for lanes, candidate in candidates.items():
        mismatch = mismatch_of(candidate)
        if mismatch is None:
            return candidate
        mismatches.append(f"{lanes} lanes: {mismatch}")
    log.warning("%s: the fused kernel differs from torch's ops on this CPU (%s; torch's dispatch: %s); torch's ops "
                "run", name, "; ".join(mismatches) or "no kernel to try", torch.backends.cpu.get_cpu_capability())
    return None


def _norm_of(kernel: Int8Kernel, lanes: int):
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if (x.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] in NORM_WIDTHS
                and weight.dtype is torch.float32 and weight.is_contiguous()):
            return kernel.rms_norm(x, weight, eps, lanes)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)

    norm.lanes = lanes  # what a Linear's kernel call needs to compute this norm itself (``Int8DynamicLinear.fused``)
    return norm


def _norm_mismatch(norm) -> str | None:
    """Where ``norm`` differs from torch's ``rms_norm`` on seeded random rows (widths, scales and row counts of
    real models and odd ones), else None."""
    generator = torch.Generator().manual_seed(0)
    for width in (16, 64, 100, 576, 600, 896, 1536, 2048, 3072, 4096, 5120, 8192):
        for scale in (1e-3, 1.0, 30.0):
            x = torch.randn(3, width, generator=generator) * scale
            weight = torch.randn(width, generator=generator)
            expected = torch.nn.functional.rms_norm(x, (width,), weight, 1e-6)
            if not torch.equal(norm(x, weight, 1e-6), expected):
                return f"width {width}, scale {scale}"
    return None


@functools.cache
def fused_silu_mul():
    """``gated(gate_up)``: ``F.silu(gate) * up`` of fp32 ``gate_up`` rows ``[rows, 2 * inter]`` (gate columns first),
    bit for bit, in one kernel call (``silu.c``, calling torch's own SLEEF exp); None where the kernel cannot run or
    does not reproduce torch here. Decided once per process, as ``fused_rms_norm``: the vector width (8 or 16 floats)
    whose output equals torch's ops on seeded random rows is taken; where neither does, torch's ops run (one log
    line)."""
    kernel = int8_kernel()
    if kernel is None:
        return None
    try:
        sleef = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        addresses = [ctypes.cast(getattr(sleef, name), ctypes.c_void_p) if hasattr(sleef, name) else None
                     for name in ("Sleef_expf8_u10", "Sleef_expf16_u10")]
    except OSError as error:
        log.warning("SiLU: torch's SLEEF functions could not be found (%s); torch's ops run", error)
        return None
    if "avx512f" not in cpu_flags():
        addresses[1] = None
    kernel.lib.silu_use_exp(*addresses)
    candidates = {lanes: _silu_mul_of(kernel, lanes)
                  for lanes, address in zip((8, 16), addresses, strict=True) if address is not None}
    return _matching("SiLU", candidates, _silu_mul_mismatch)


def _silu_mul_of(kernel: Int8Kernel, lanes: int):
    def gated(gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2)
        kernel.lib.silu_mul_rows(gate_up.data_ptr(), rows, width // 2, lanes, out.data_ptr())
        return out

    gated.lanes = lanes  # what an MLP's kernel call needs to compute this itself (``Int8DynamicLinear.fused_mlp``)
    return gated


def _silu_mul_mismatch(gated) -> str | None:
    """Where ``gated`` differs from torch's ``F.silu(gate) * up`` on seeded random rows (widths of real models and
    odd ones, values from tiny to past exp's range), else None."""
    generator = torch.Generator().manual_seed(0)
    for width in (7, 16, 40, 100, 1536, 2048, 4864, 8960, 11008, 14336):
        for scale in (1e-3, 1.0, 8.0, 100.0):
            gate_up = torch.randn(3, 2 * width, generator=generator) * scale
            gate, up = gate_up.chunk(2, dim=-1)
            if not torch.equal(gated(gate_up), torch.nn.functional.silu(gate) * up):
                return f"width {width}, scale {scale}"
    return None

