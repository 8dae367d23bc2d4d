"""Which CPU a benchmark ran on, as every results table names it: the model name and the vector and matrix
extensions the kernels choose between (``grep -o -w 'avx512[a-z_0-9]*\\|avx2\\|amx[a-z_0-9]*' /proc/cpuinfo | sort
-u``), and the settings that hold a run to AVX2 on a CPU that has more (``ATEN_CPU_CAPABILITY``,
``LLM_INT8_KERNEL_ISA``, ...), since the same machine then measures the other machine kind's code paths."""

from __future__ import annotations

import os
import re
from pathlib import Path

# the settings that change which instructions our server's kernels and libraries use
ISA_SETTINGS = ("ATEN_CPU_CAPABILITY", "LLM_INT8_KERNEL_ISA", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                "FBGEMM_ENABLE_INSTRUCTIONS")
_FLAGS = re.compile(r"^(avx512[a-z_0-9]*|avx2|amx[a-z_0-9]*)$")


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first ``model name`` of /proc/cpuinfo (``platform.processor()`` is often empty on Linux)."""
    for line in _read(cpuinfo).splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The AVX2, AVX-512 and AMX flags the CPU reports, sorted and each once (what the grep above prints)."""
    found = {word for line in _read(cpuinfo).splitlines() if line.startswith("flags")
             for word in line.split(":", 1)[1].split() if _FLAGS.match(word)}
    return sorted(found)


def cpu_label(env: dict[str, str] | None = None, cpuinfo: str | None = None) -> str:
    """The CPU column of a results table: model name, flags, and the ISA settings ``env`` (else this process's
    environment) holds the run to."""
    env = os.environ if env is None else env
    held = [f"{name}={env[name]}" for name in ISA_SETTINGS if env.get(name)]
    label = f"{cpu_model(cpuinfo)}: {' '.join(cpu_flags(cpuinfo)) or 'no AVX2'}"
    return label + (f" (held: {', '.join(held)})" if held else "")


def _read(cpuinfo: str | None) -> str:
    if cpuinfo is not None:
        return cpuinfo
    try:
        return Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""
