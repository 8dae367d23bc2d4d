"""The process's own environment knobs (``LLM_*``): which kernels run and where the start caches live. They are not
settings (no ``option.*`` key, nothing a request or ``serving.properties`` changes): the image sets the caches, and
tests, benchmarks and CI hold the kernels to a path with them. ``KNOBS`` is the one table of them, with each one's
default and meaning; the server reads them through ``knob`` and ``path_knob`` only.

Settings and their environment names are ``handler.config`` (``ENV_NAMES``). This module is apart from it, and
imports nothing of the server, so that the model code (``handler.engine.model``, which is given its settings as
arguments and never imports ``handler.config``) reads its kernel knobs here. One exception:
``engine/model/kernels/build.py`` run as a file (the image's build stage, without the package) reads
``LLM_KERNEL_CACHE`` itself, with the default declared here (``tests/unit/test_knobs.py`` holds both to it).

May import: nothing of the server.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class Knob(NamedTuple):
    default: str
    meaning: str


KNOBS = {
    "LLM_INT8_KERNEL": Knob("auto", "``torch``: the int8 Linears run through torch's ops (the kernel's reference, the "
                                    "same numbers, slowly) instead of our C kernel"),
    "LLM_INT8_KERNEL_ISA": Knob("auto", "``avx2``: our kernels (int8 Linear, attention) sum with AVX2 on a CPU with "
                                        "AVX-512, as an AVX2-only machine does (the same bits, its speed)"),
    "LLM_ATTENTION_KERNEL": Knob("auto", "``torch``: attention runs as torch's matmuls instead of our kernel"),
    "LLM_KERNEL_CACHE": Knob("~/.cache/sagemaker-llm/kernels", "the folder our compiled kernels are kept in (the "
                                                                "image sets its prebuilt one)"),
    "LLM_INT8_CACHE": Knob("~/.cache/sagemaker-llm/int8", "the folder a start keeps what it computed once per model "
                                                          "folder in (``start_cache``; the image sets its own)"),
    "LLM_INT8_ACTIVATION_BITS": Knob("", "retired (the int8 activations' earlier numerics): a start that sets it "
                                         "warns and ignores it"),
}


def knob(name: str) -> str:
    """The knob's value in this process's environment now, else its default (a name not in ``KNOBS`` is a
    KeyError: every knob is declared there)."""
    return os.environ.get(name, KNOBS[name].default)


def path_knob(name: str) -> Path:
    """A folder knob: the environment's value as written, else the default with ``~`` as the user's home."""
    default = KNOBS[name].default
    return Path(os.environ[name]) if name in os.environ else Path(default).expanduser()
