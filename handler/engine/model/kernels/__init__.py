"""The lean engine's own CPU kernel: the 14-bit split int8 Linear for a decode step's few rows (``int8_gemv.c``).

Why our own: at batch 1 the split Linear was a dozen small torch ops around fbgemm's GEMM, and their dispatch cost
more than the matrix product; fbgemm's GEMM is also built for many rows. The C kernel quantises the rows, reads the
int8 weights once for all of them with AVX2's u8*s8 products, and applies the same float epilogue, giving the same
bits as the torch path (``tests/unit/test_int8_kernel.py``), so a row's answer does not depend on which path ran.

It is plain C, built with the system compiler in about a second (no torch headers) into a cache keyed by its source
and flags, and loaded with ctypes: ``make model`` and the image build it ahead; a start builds it if it is missing.
Without AVX2 or a compiler the torch path runs (one log line says so).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_gemv.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared"]
MAX_ROWS = 8  # int8_gemv.c's MAX_ROWS


def cache_dir() -> Path:
    return Path(os.environ.get("LLM_KERNEL_CACHE", Path.home() / ".cache" / "sagemaker-llm" / "kernels"))


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / f"int8_gemv-{digest}.so"


def build() -> Path:
    """The compiled library (built once per source and flags; concurrent builders wait for each other)."""
    target = library_path()
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            result = subprocess.run([compiler, *FLAGS, "-o", str(partial), str(SOURCE), "-lpthread", "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise OSError(f"{compiler} failed: {result.stderr.strip()[-400:]}")
            partial.rename(target)
    return target


class Int8Kernel:
    """The loaded library: ``split_linear`` for up to ``MAX_ROWS`` rows, on ``threads`` threads."""

    def __init__(self, path: Path, threads: int) -> None:
        self.lib = ctypes.CDLL(str(path))
        pointer, integer = ctypes.c_void_p, ctypes.c_int
        self.lib.int8_split_linear.argtypes = [pointer, integer, integer, pointer, pointer, pointer, pointer,
                                               pointer, integer, pointer, pointer]
        self.lib.int8_split_linear.restype = integer
        self.lib.int8_gemv_threads.argtypes = [integer]
        self.threads = self.lib.int8_gemv_threads(threads)
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


def int8_kernel() -> Int8Kernel | None:
    """This process's kernel, built and loaded on first use; None where it cannot run (no AVX2, no compiler,
    ``LLM_INT8_KERNEL=torch``), with one log line saying why."""
    global _KERNEL, _TRIED
    if _TRIED:
        return _KERNEL
    _TRIED = True
    if os.environ.get("LLM_INT8_KERNEL", "auto") == "torch":
        return None
    from handler.engine.model.linear import _cpu_flags

    if not {"avx2", "fma"} <= _cpu_flags():
        log.info("int8: no AVX2 and FMA on this CPU; a decode step's Linears run through torch and fbgemm")
        return None
    try:
        _KERNEL = Int8Kernel(build(), torch.get_num_threads())
    except OSError as error:
        log.warning("int8: the decode kernel could not be built (%s); a decode step's Linears run through torch "
                    "and fbgemm (slower at batch 1, the same numbers)", error)
    return _KERNEL
