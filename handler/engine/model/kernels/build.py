"""Compile the kernels' C files beside this one (``int8_linear.c``, ``rms_norm.c``, ...) into one library in the kernel
cache its caller names (``LLM_KERNEL_CACHE``, read through ``handler.knobs``). Standard library only, so an image's
build stage can run it as a file: ``python3 handler/engine/model/kernels/build.py`` prints the library's path, in
``$LLM_KERNEL_CACHE`` else the default ``handler.knobs`` declares. The library's name carries a digest of its
sources and flags, so a changed kernel is never served from a stale build."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]


def library_path(cache: Path) -> Path:
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES) + " ".join(FLAGS).encode())
    return cache / f"kernels-{digest.hexdigest()[:16]}.so"


def build(cache: Path) -> Path:
    """The compiled library in the folder ``cache`` (built once per source and flags; concurrent builders wait for
    each other)."""
    target = library_path(cache)
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
            result = subprocess.run([compiler, *FLAGS, "-o", str(partial), *map(str, SOURCES), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise OSError(f"{compiler} failed: {result.stderr.strip()[-400:]}")
            partial.rename(target)
    return target


if __name__ == "__main__":
    try:  # run as a file, without the package: LLM_KERNEL_CACHE and its default as handler.knobs declares them
        print(build(Path(os.environ.get("LLM_KERNEL_CACHE", "~/.cache/sagemaker-llm/kernels")).expanduser()))
    except OSError as error:
        sys.exit(f"int8 kernel: {error}")
