"""Compile the kernels' C files beside this one (``int8_linear.c``, ``rms_norm.c``, ...) into one library in the kernel
cache (standard library only, so an image's build stage can run it as a file: ``python3
handler/engine/model/kernels/build.py`` prints the library's path). The library's name carries a digest of its
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


def cache_dir() -> Path:
    """``LLM_KERNEL_CACHE`` (the image sets it to its prebuilt folder), else the user's cache."""
    return Path(os.environ.get("LLM_KERNEL_CACHE", Path.home() / ".cache" / "sagemaker-llm" / "kernels"))


def library_path() -> Path:
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES) + " ".join(FLAGS).encode())
    return cache_dir() / f"kernels-{digest.hexdigest()[:16]}.so"


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
            result = subprocess.run([compiler, *FLAGS, "-o", str(partial), *map(str, SOURCES), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise OSError(f"{compiler} failed: {result.stderr.strip()[-400:]}")
            partial.rename(target)
    return target


if __name__ == "__main__":
    try:
        print(build())
    except OSError as error:
        sys.exit(f"int8 kernel: {error}")
