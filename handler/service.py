"""Wires settings to a running backend: resolves device, dtype, limits and request defaults, picks the backend,
loads the model in the background, and owns what the prompt layer renders with (renderer, vision encoder)."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from handler import metrics
from handler.config import Settings, check_lean_settings, vllm_installed
from handler.djl import UserHandler, find_entry_point
from handler.engine.backend import Admission, EngineBackend, EngineLimits
from handler.engine.engine import Engine, LoadedModel
from handler.errors import ConfigError, NotFound
from handler.preflight import context_length
from handler.prompt.renderer import PromptRenderer
from handler.prompt.vision import VisionRenderer, image_loader

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Resolved:
    device: str
    dtype: str
    quantize: bool


def resolve(settings: Settings, cuda_available: bool) -> Resolved:
    device = settings.device if settings.device != "auto" else ("cuda" if cuda_available else "cpu")
    if device == "cuda" and not cuda_available:
        raise ConfigError("option.device='cuda': no CUDA device is visible")
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    quantize = settings.quantize == "dynamic_int8" or (
        settings.quantize == "auto" and device == "cpu" and dtype == "float32")
    if quantize and (device != "cpu" or dtype != "float32"):
        raise ConfigError("option.quantize='dynamic_int8' needs option.device=cpu and option.dtype=float32")
    if settings.int8_split != "auto" and not quantize:
        raise ConfigError(f"option.int8_split={settings.int8_split!r} shapes the lean engine's int8, which this "
                          "start does not use (option.quantize=none, or not fp32 on CPU)")
    return Resolved(device, dtype, quantize)


def engine_limits(settings: Settings) -> EngineLimits:
    config = json.loads((settings.model_dir / "config.json").read_text())
    if "vision_config" in config:  # a vision-language model: its language model sets the context
        from handler.engine.vision import language_config

        try:
            config = language_config(config)
        except ValueError as error:
            raise ConfigError(f"{settings.model_dir}: {error}") from None
    return EngineLimits(max_running=settings.max_rolling_batch_size, max_model_len=context_length(settings, config),
                        max_step_tokens=max(settings.max_num_batched_tokens, settings.max_rolling_batch_size + 1))


@dataclass(frozen=True, slots=True)
class RequestDefaults:
    """What a request gets for a field it leaves out, decided here only. (A chat or completions request without
    max_tokens may run to the context limit: that is the engine's meaning of ``max_new_tokens=None``.)"""

    temperature: float          # chat and completions: the model's own, from generation_config.json
    max_new_tokens: int         # legacy schema: option.default_max_new_tokens


def request_defaults(settings: Settings) -> RequestDefaults:
    """The model's sampling temperature from generation_config.json when it samples by default, else 0 (greedy)."""
    path = settings.model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    temperature = float(config.get("temperature", 1.0)) if config.get("do_sample") else 0.0
    return RequestDefaults(temperature, settings.default_max_new_tokens)


def uses_vllm(settings: Settings) -> bool:
    """option.rolling_batch=vllm; auto: when vLLM is installed and a CUDA device is visible (on CPU the lean engine
    is faster). Without vLLM installed, nothing here imports torch or vLLM."""
    if settings.rolling_batch == "vllm":
        return True
    if settings.rolling_batch != "auto" or settings.device == "cpu" or not vllm_installed():
        return False
    import torch

    return torch.cuda.is_available()


def create_backend(settings: Settings, load: Callable[[], LoadedModel], on_ready: Callable[[], None],
                   on_failed: Callable[[str], None], prepare_vllm: Callable[[], object] | None = None) -> EngineBackend:
    """The backend ``option.rolling_batch`` names, with its limits, admission and stats listener. vllm (and auto on
    CUDA with vLLM installed): vLLM's engine, ``prepare_vllm`` giving its arguments; otherwise the lean engine, whose
    runner's model code is ``loader.choose_path``'s choice, and which refuses vLLM-only settings."""
    admission = Admission(settings.max_queue_size, settings.request_timeout)
    if prepare_vllm is not None and uses_vllm(settings):
        from handler.engine.vllm_backend import VllmBackend  # imports vLLM: only when it serves

        return VllmBackend(prepare_vllm, engine_limits(settings), admission, metrics.record_step, on_ready, on_failed)
    check_lean_settings(settings)
    return Engine(load, engine_limits(settings), admission, metrics.record_step, on_ready, on_failed)


class HandlerOnly:
    """The backend when a user's ``model.py`` runs its own model and does not ask for ours: nothing loads, and the
    built-in routes are refused with the reason (``server`` does not register them; ``submit`` says it too)."""

    limits = None
    load_error: str | None = None
    is_ready = True
    is_alive = True

    def __init__(self, handler_name: str) -> None:
        self.reason = (f"the built-in engine is not loaded: {handler_name} serves this model on /invocations "
                       "(option.builtin_engine=true loads it, as does importing builtin_handle in the handler)")

    def start(self) -> None:
        log.info("%s", self.reason)

    def stop(self, reason: str | None = None) -> None:
        return None

    def wait_ready(self, timeout: float | None = None) -> bool:
        return True

    def submit(self, request):
        raise NotFound(self.reason)


def serves_builtin(settings: Settings, user_handler: UserHandler | None) -> bool:
    """Whether the built-in engine loads: always without a user handler; with one, when the handler can call
    ``builtin_handle`` or ``option.builtin_engine=true`` says so (LMI loads only what the handler loads)."""
    wanted = user_handler is None or settings.builtin_engine == "true" or (
        settings.builtin_engine == "auto" and user_handler.calls_builtin)
    if wanted and not (settings.model_dir / "config.json").is_file():
        raise ConfigError(f"{user_handler.name} calls builtin_handle, and the built-in engine needs a checkpoint: "
                          f"{settings.model_dir} has no config.json (or set option.builtin_engine=false)")
    return wanted


class ModelService:
    """The engine, and the prompt renderer the protocol layer uses; both ready once the model has loaded."""

    def __init__(self, settings: Settings, num_threads: int | None = None,
                 on_loaded: Callable[[], None] = lambda: None,
                 on_load_failed: Callable[[str], None] = lambda reason: None) -> None:
        self.settings = settings
        self.model_name = settings.model_dir.name
        self.renderer: PromptRenderer | None = None
        self.engine_path: str | None = None  # "lean" or "transformers" once loaded
        self._num_threads = num_threads
        entry_point = find_entry_point(settings.model_dir, settings.entryPoint)
        self.handler_properties = {k: str(v) for k, v in settings.model_dump().items() if v is not None}
        self.handler_properties["model_dir"] = str(settings.model_dir)
        self.user_handler = UserHandler(entry_point, self.handler_properties) if entry_point else None
        self.handler_error: str | None = None
        self.serves_builtin = serves_builtin(settings, self.user_handler)
        if self.serves_builtin:
            self.engine: EngineBackend | HandlerOnly = create_backend(settings, self._load, on_loaded, on_load_failed,
                                                                      self._prepare_vllm)
        else:
            self.engine = HandlerOnly(self.user_handler.name)
        self.defaults = request_defaults(settings)

    def start(self) -> None:
        self.engine.start()
        if self.user_handler is not None:
            threading.Thread(target=self._initialise_user_handler, name="handler-init", daemon=True).start()

    @property
    def is_ready(self) -> bool:
        handler_ready = self.user_handler is None or self.user_handler.is_initialised
        return self.engine.is_ready and handler_ready

    @property
    def load_error(self) -> str | None:
        return self.engine.load_error or self.handler_error

    def _initialise_user_handler(self) -> None:
        """LMI's first call: an empty input, after the built-in engine is ready (the handler may use it)."""
        self.engine.wait_ready()
        try:
            self.user_handler.initialise()
        except Exception as error:
            log.exception("custom handler %s failed to initialise", self.user_handler.name)
            self.handler_error = f"custom handler {self.user_handler.name} failed to initialise: {error}"

    def _load(self) -> LoadedModel:
        import torch

        from handler.engine.loader import KVMemory, LoadOptions, load, load_tokenizer

        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        resolved = resolve(self.settings, torch.cuda.is_available())
        options = LoadOptions(self.settings.model_dir, resolved.dtype, resolved.quantize, resolved.device,
                              self.engine.limits.max_running, self.engine.limits.max_model_len,
                              self.settings.rolling_batch, self.settings.quantize == "dynamic_int8",
                              int8_split=self.settings.int8_split_sites,
                              kv_memory=KVMemory(self.settings.kv_cache_memory, self.settings.gpu_memory_utilization,
                                                 self.settings.workers, self.settings.enable_prefix_caching))
        loaded, parts = load(options, lambda: load_tokenizer(self.settings.model_dir))
        self.renderer = self._renderer(parts.tokenizer, parts.vision)
        self.engine_path = loaded.path
        metrics.record_engine_path(loaded.path, loaded.path_reason)
        log.info("loaded %s on %s (%s%s%s), pid %d", self.model_name, resolved.device, resolved.dtype,
                 ", int8 dynamic" if resolved.quantize and loaded.path == "lean" else "",
                 ", vision" if parts.vision else "", os.getpid())
        return loaded

    def _prepare_vllm(self):
        """On the vLLM backend's thread, before vLLM starts: the tokenizer the prompt layer renders with (chat
        template, tools: as on the lean engine), the vocabulary our detokenizer reads, vLLM's engine arguments."""
        from vllm.platforms import current_platform

        from handler.engine.loader import eos_token_ids, load_tokenizer
        from handler.engine.sequence import Vocabulary
        from handler.engine.vllm_args import Placement, engine_environment, engine_kwargs
        from handler.engine.vllm_backend import Prepared

        settings = self.settings
        model_config = json.loads((settings.model_dir / "config.json").read_text())
        device = current_platform.device_type
        num_gpus = 0
        if device == "cuda":
            import torch

            num_gpus = torch.cuda.device_count()
        placement = Placement(device, num_gpus, tuple(sorted(os.sched_getaffinity(0))))
        kwargs = engine_kwargs(settings, placement, self.engine.limits.max_model_len, model_config)
        os.environ.update(engine_environment(settings, placement, dict(os.environ)))  # vLLM's processes inherit it
        tokenizer = load_tokenizer(settings.model_dir)
        images = None
        if "vision_config" in model_config:  # vLLM runs the vision tower: the prompt layer hands it decoded images
            from handler.engine.vision import ImageProcessor

            images = ImageProcessor.load(settings.model_dir)
        self.renderer = self._renderer(tokenizer, images)
        self.engine_path = "vllm"
        metrics.record_engine_path("vllm", f"option.rolling_batch={settings.rolling_batch}, {device}")
        vocabulary = Vocabulary(tokenizer.backend_tokenizer, eos_token_ids(settings.model_dir, tokenizer),
                                frozenset(tokenizer.all_special_ids))
        return Prepared(kwargs, vocabulary)

    def _renderer(self, tokenizer, encoder) -> PromptRenderer:
        settings = self.settings
        if encoder is None:
            return PromptRenderer(tokenizer, settings.tool_call_parser)
        return VisionRenderer(tokenizer, settings.tool_call_parser, encoder, image_loader(settings),
                              settings.max_images_per_request)
