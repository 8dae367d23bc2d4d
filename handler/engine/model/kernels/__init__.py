"""The lean engine's own CPU kernel: the 14-bit split int8 Linear for a decode step's few rows (``int8_gemv.c``).

Why our own: at batch 1 the split Linear was a dozen small torch ops around fbgemm's GEMM, and their dispatch cost
more than the matrix product; fbgemm's GEMM is also built for many rows. The C kernel quantises the rows, reads the
int8 weights once for all of them with AVX2's u8*s8 products, and applies the same float epilogue, giving the same
bits as the torch path (``tests/unit/test_int8_kernel.py``), so a row's answer does not depend on which path ran.

It is plain C, built with the system compiler in about a second (no torch headers; ``build``) into a cache keyed by
its source and flags, and loaded with ctypes: ``make model`` and the image build it ahead; a start builds it if it is
missing. Without AVX2 and FMA, or a compiler, the torch path runs (one log line says so); ``LLM_INT8_KERNEL=torch``
forces it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

import torch

from handler.engine.model.kernels.build import build

log = logging.getLogger(__name__)

MAX_ROWS = 8  # int8_gemv.c's MAX_ROWS
# Up to how many rows a Linear takes the kernel: it reads the weights once for all rows, but its per-row arithmetic
# is plainer than fbgemm's, which wins from 4 rows (measured on the 576 -> 3072 projection, 2 threads, AVX2: 1 row
# 97 us against 174, 2 rows 161 against 195, 4 rows 277 against 254)
KERNEL_ROWS = 3


class Int8Kernel:
    """The loaded library: ``split_linear`` for up to ``MAX_ROWS`` rows, on torch's OpenMP threads."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        pointer, integer = ctypes.c_void_p, ctypes.c_int
        self.lib.int8_split_linear.argtypes = [pointer, integer, integer, pointer, pointer, pointer, pointer,
                                               pointer, integer, pointer, pointer]
        self.lib.int8_split_linear.restype = integer
        self.codes = torch.empty(0, dtype=torch.uint8)

    def split_linear(self, x: torch.Tensor, weight: torch.Tensor, col_sums: torch.Tensor, scales: torch.Tensor,
                     row_sums: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` ``[rows, k]`` fp32 contiguous, ``rows <= MAX_ROWS``; the weights as ``Int8DynamicLinear`` keeps
        them for this kernel."""
        rows, k = x.shape
        n = weight.shape[0]
        if self.codes.numel() < 2 * rows * k:
            self.codes = torch.empty(2 * MAX_ROWS * k, dtype=torch.uint8)
        y = torch.empty(rows, n)
        self.lib.int8_split_linear(x.data_ptr(), rows, k, weight.data_ptr(), col_sums.data_ptr(), scales.data_ptr(),
                                   row_sums.data_ptr(), None if bias is None else bias.data_ptr(), n,
                                   self.codes.data_ptr(), y.data_ptr())
        return y


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
        if os.environ.get("LLM_INT8_KERNEL", "auto") == "torch":
            return None
        if not {"avx2", "fma"} <= cpu_flags():
            log.info("int8: no AVX2 and FMA on this CPU; a decode step's Linears run through torch and fbgemm")
            return None
        try:
            _KERNEL = Int8Kernel(build())
        except OSError as error:
            log.warning("int8: the decode kernel could not be built (%s); a decode step's Linears run through "
                        "torch and fbgemm (slower at batch 1, the same numbers)", error)
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
