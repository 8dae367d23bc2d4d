"""What the benchmarks' CPU column says (``bench/machine.py``), from /proc/cpuinfo text of the two machine kinds."""

from __future__ import annotations

from bench.machine import cpu_flags, cpu_label, cpu_model

EPYC = """processor\t: 0
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu sse sse2 avx avx2 fma bmi2 sha_ni
processor\t: 1
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu sse sse2 avx avx2 fma bmi2 sha_ni
"""
XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu avx2 avx512f avx512dq avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx_vnni avx512vl
"""


def test_the_cpu_column_names_the_model_and_its_vector_flags() -> None:
    assert cpu_model(EPYC) == "AMD EPYC 7R13 Processor"
    assert cpu_flags(EPYC) == ["avx2"]
    assert cpu_flags(XEON) == ["amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16", "avx512_vnni", "avx512dq",
                               "avx512f", "avx512vl"]  # what `grep -o -w ... | sort -u` prints (avx_vnni is not asked)
    assert cpu_label({}, EPYC) == "AMD EPYC 7R13 Processor: avx2"


def test_a_run_held_to_avx2_says_so() -> None:
    env = {"ATEN_CPU_CAPABILITY": "avx2", "LLM_INT8_KERNEL_ISA": "avx2", "PATH": "/bin"}
    assert cpu_label(env, XEON).endswith("(held: ATEN_CPU_CAPABILITY=avx2, LLM_INT8_KERNEL_ISA=avx2)")
    assert cpu_label({}, "") == "unknown CPU: no AVX2"
