"""Which backend serves a model folder, and building it; the one module outside code asks about models.

``create_backend`` picks from ``option.rolling_batch``: vLLM's engine (``vllm/``, imported only then), or the lean
engine (``lean/``), whose runner runs our model or the checkpoint's transformers model (``lean.paths.choose_path``).
Each calls ``on_parts`` once it has loaded, with what the prompt layer renders with (``core.tokenizer.PromptParts``)
and which path serves. The folder checks here (``lean_refusal``, ``language_config``) are for the server's master
process and the service: this module imports neither torch nor vLLM until a backend is built.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from handler.config import Settings, check_lean_settings
from handler.config_sources import vllm_installed
from handler.engine.backend import Admission, EngineBackend, EngineLimits, EngineStats
from handler.engine.types import PromptParts

# (parts, path: "lean" | "transformers" | "vllm", why) -> the reasoning format the prompt layer reads in the chat
# template (``option.reasoning_parser``, or detected under ``auto``): vLLM gates structured outputs by it
PartsListener = Callable[[PromptParts, str, str], str | None]


def uses_vllm(settings: Settings) -> bool:
    """option.rolling_batch=vllm; auto: when vLLM is installed and a CUDA device is visible (on CPU the lean engine
    is faster). Without vLLM installed, nothing here imports torch or vLLM."""
    if settings.rolling_batch == "vllm":
        return True
    if settings.rolling_batch != "auto" or settings.device == "cpu" or not vllm_installed():
        return False
    import torch

    return torch.cuda.is_available()


def create_backend(settings: Settings, limits: EngineLimits, on_parts: PartsListener,
                   on_stats: Callable[[EngineStats], None] | None = None,
                   on_ready: Callable[[], None] = lambda: None,
                   on_failed: Callable[[str], None] = lambda reason: None,
                   num_threads: int | None = None) -> EngineBackend:
    """The backend ``option.rolling_batch`` names, with its limits, admission and stats listener; it loads on its
    own thread once started. The lean engine refuses vLLM-only settings here, naming them."""
    admission = Admission(settings.max_queue_size, settings.request_timeout)
    if uses_vllm(settings):
        from handler.engine.vllm.backend import VllmBackend  # imports vLLM: only when it serves
        from handler.engine.vllm.prepare import prepare

        backend = VllmBackend(lambda: prepare(settings, limits.max_model_len, on_parts), limits, admission, on_stats,
                              on_ready, on_failed)
        if settings.enable_lora:
            backend.enable_adapters(settings.max_lora_rank, settings.model_dir)
        return backend
    check_lean_settings(settings)
    from handler.engine.lean.engine import Engine
    from handler.engine.lean.load import load_for

    return Engine(lambda: load_for(settings, limits, on_parts, num_threads), limits, admission, on_stats, on_ready,
                  on_failed)


def language_config(config: dict) -> dict:
    """The config whose context and shape the engine serves: a vision-language model's language model's (raises
    ``ValueError`` naming what is missing), else the config itself."""
    if "vision_config" not in config:
        return config
    from handler.engine.model.vision import language_config as of_vision_model

    return of_vision_model(config)


def lean_refusal(folder: Path, max_model_len: int) -> str | None:
    """Why the lean engine cannot serve this text model folder (from config.json and the safetensors headers: no
    weight is read, torch is not imported), or None."""
    from handler.engine.model.support import UnsupportedModel, check_lean_folder

    try:
        check_lean_folder(folder, max_model_len)
    except UnsupportedModel as error:
        return str(error)
    return None
