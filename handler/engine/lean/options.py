"""The settings as the lean engine's load reads them: ``auto`` device, dtype and int8 made concrete (``resolve``),
the retired int8 settings warned about (``warn_retired``), and ``options_from``, the ``LoadOptions`` that ``load``
takes. The one module of the lean load that reads ``Settings``: what follows it (and the model code) takes options.

May import: ``handler.config``, ``handler.errors``, ``handler.knobs``, ``backend``'s limits and the int8 Linear's
block size (``model.linear``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from handler.config import Settings
from handler.engine.backend import EngineLimits
from handler.engine.model.linear import ACTIVATION_BLOCK
from handler.errors import ConfigError
from handler.knobs import knob

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class KVMemory:
    """How much memory the KV cache may take (``option.kv_cache_memory``, on CUDA also
    ``option.gpu_memory_utilization``), and whether it keeps prefixes (``option.enable_prefix_caching``)."""

    amount: str | None = None          # bytes or a fraction of the available memory (``config.memory_amount``)
    gpu_memory_utilization: float | None = None
    workers: int = 1                   # processes sharing the machine's memory, each with its own cache
    prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class LoadOptions:
    model_dir: Path
    dtype: str                 # a key of DTYPES
    quantize: bool             # int8 dynamic quantisation of the Linear layers (CPU)
    device: str                # "cpu" or "cuda"
    max_running: int
    max_model_len: int
    rolling_batch: str = "lean"  # option.rolling_batch: "auto" | "lean" | "transformers"
    quantize_asked: bool = False  # int8 named explicitly (not only auto's CPU default)
    kv_memory: KVMemory = KVMemory()
    speculation: SpeculationOptions | None = None
    lora: LoraOptions | None = None   # option.enable_lora: serve LoRA adapters
    cuda_graphs: bool = False         # on CUDA, decode steps replay recorded graphs (option.enforce_eager=false)


@dataclass(frozen=True, slots=True)
class LoraOptions:
    """option.max_loras (loaded at once) and option.max_lora_rank."""

    max_loras: int = 4
    max_rank: int = 16


@dataclass(frozen=True, slots=True)
class SpeculationOptions:
    """option.speculative_draft_model (a folder, or ``ngram``), option.speculative_length, and prompt lookup's
    n-gram lengths (option.prompt_lookup_min / max)."""

    draft: str
    length: int = 5
    lookup_min: int = 3
    lookup_max: int = 5


@dataclass(frozen=True, slots=True)
class Resolved:
    device: str
    dtype: str
    quantize: bool


def resolve(settings: Settings, cuda_available: bool) -> Resolved:
    """``auto`` device, dtype and int8 made concrete: CUDA when visible, bf16 there and fp32 on CPU, int8 on CPU in
    fp32; combinations that cannot run are refused naming the key."""
    device = settings.device if settings.device != "auto" else ("cuda" if cuda_available else "cpu")
    if device == "cuda" and not cuda_available:
        raise ConfigError("option.device='cuda': no CUDA device is visible")
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    quantize = settings.quantize == "dynamic_int8" or (
        settings.quantize == "auto" and device == "cpu" and dtype == "float32")
    if quantize and (device != "cpu" or dtype != "float32"):
        raise ConfigError("option.quantize='dynamic_int8' needs option.device=cpu and option.dtype=float32")
    return Resolved(device, dtype, quantize)


def warn_retired(settings: Settings) -> None:
    """The settings of the int8 activations' earlier numerics (14-bit rows split in two 7-bit halves, or 7 or 8 bits
    per row by CPU), retired: one warning each where set, and ignored. Every layer's activations now take 16-bit
    codes per block of ``ACTIVATION_BLOCK`` inputs, the same integers on every CPU, in one pass: the answers ``all``
    gave, faster than ``none`` ran."""
    why = (f"the int8 layers' activations are 16-bit codes per block of {ACTIVATION_BLOCK} inputs, the same integers "
           "on every CPU, in one pass (docs/development.md: Numerics)")
    if settings.int8_split != "auto":
        log.warning("option.int8_split=%s is retired and ignored: %s", settings.int8_split, why)
    if bits := knob("LLM_INT8_ACTIVATION_BITS"):
        log.warning("LLM_INT8_ACTIVATION_BITS=%s is retired and ignored: %s", bits, why)


def options_from(settings: Settings, limits: EngineLimits, resolved: Resolved) -> LoadOptions:
    """What ``load`` takes of the settings, the engine's limits and the resolved device, dtype and int8."""
    return LoadOptions(settings.model_dir, resolved.dtype, resolved.quantize, resolved.device,
                       limits.max_running, limits.max_model_len, settings.rolling_batch,
                       settings.quantize == "dynamic_int8",
                       kv_memory=KVMemory(settings.kv_cache_memory, settings.gpu_memory_utilization,
                                          settings.workers, settings.enable_prefix_caching),
                       speculation=speculation_options(settings),
                       lora=lora_options(settings), cuda_graphs=settings.enforce_eager is False)


def lora_options(settings: Settings) -> LoraOptions | None:
    return LoraOptions(settings.max_loras, settings.max_lora_rank) if settings.enable_lora else None


def speculation_options(settings: Settings) -> SpeculationOptions | None:
    """The speculative-decoding settings; None when option.speculative_draft_model is unset."""
    draft = settings.speculative_draft_model
    if draft is None:
        return None
    if settings.prompt_lookup_min > settings.prompt_lookup_max:
        raise ConfigError(f"option.prompt_lookup_min={settings.prompt_lookup_min} is above "
                          f"option.prompt_lookup_max={settings.prompt_lookup_max}")
    draft = "ngram" if settings.drafts_by_lookup else draft
    return SpeculationOptions(draft, settings.draft_length, settings.prompt_lookup_min, settings.prompt_lookup_max)
