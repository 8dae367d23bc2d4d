"""Wires settings to a running backend: resolves device, dtype, limits and request defaults, picks the backend,
loads the model in the background, and owns what the prompt layer renders with (renderer, vision encoder), the
LoRA adapters and the stateful sessions shared by the workers, and a user's handler when the model folder brings one.

May import: ``handler.config``, ``handler.errors``, ``metrics``, the engine's interface (``backend``, ``loader``,
``types``), the prompt layer, ``process.preflight``, ``adapter_registry``, ``sessions`` and ``djl.loading``.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from handler import metrics, threads
from handler.adapter_registry import SharedAdapters
from handler.config import Settings
from handler.djl.loading import UserHandler, find_entry_point
from handler.engine.backend import EngineBackend, EngineLimits
from handler.engine.loader import create_backend, language_config
from handler.engine.types import PromptParts
from handler.errors import ConfigError, NotFound
from handler.process.preflight import context_length
from handler.prompt.renderer import PromptRenderer
from handler.prompt.vision import VisionRenderer, image_loader
from handler.sessions import SessionStore

log = logging.getLogger(__name__)


def engine_limits(settings: Settings) -> EngineLimits:
    config = json.loads((settings.model_dir / "config.json").read_text())
    try:  # a vision-language model: its language model sets the context
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


def session_store(settings: Settings, on_end: Callable[[str], None]) -> SessionStore | None:
    """The stateful sessions (option.enable_stateful_sessions), in the folder the workers share (the master makes
    one before forking when option.sessions_path names none; a server made without the master gets its own)."""
    if not settings.enable_stateful_sessions:
        return None
    named = settings.sessions_path
    folder = Path(named) if named else Path(tempfile.mkdtemp(prefix="sagemaker-sessions-"))
    return SessionStore(folder, settings.sessions_expiration, on_end)


class HandlerOnly:
    """The backend when a user's ``model.py`` runs its own model and does not ask for ours: nothing loads, and the
    built-in routes are refused with the reason (``server`` does not register them; ``submit`` says it too)."""

    limits = None
    load_error: str | None = None
    is_ready = True
    is_alive = True
    embeds_only = False
    score_type = None
    adapters = None

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

    def end_session(self, session_id: str) -> None:
        return None

    def embed(self, request):
        raise NotFound(self.reason)

    def score(self, request):
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
        self.model_name = settings.served_model_name or settings.model_dir.name
        metrics.set_model_name(self.model_name)
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
            self.engine: EngineBackend | HandlerOnly = create_backend(
                settings, engine_limits(settings), self._on_parts, metrics.record_step, on_loaded, on_load_failed,
                num_threads)
        else:
            self.engine = HandlerOnly(self.user_handler.name)
        self.defaults = request_defaults(settings)
        self._shared_adapters: SharedAdapters | None = None
        self._adapters_lock = threading.Lock()
        self.sessions = session_store(settings, self.engine.end_session)

    def start(self) -> None:
        threads.on_restart(metrics.record_thread_restart)
        self.engine.start()
        if self.user_handler is not None:
            threading.Thread(target=self._initialise_user_handler, name="handler-init", daemon=True).start()

    @property
    def is_ready(self) -> bool:
        handler_ready = self.user_handler is None or self.user_handler.is_initialised
        return self.engine.is_ready and handler_ready

    @property
    def adapters(self) -> SharedAdapters | None:
        """The LoRA adapters, kept equal across the server's workers (None while the backend serves none)."""
        store = self.engine.adapters
        if store is None:
            return None
        with self._adapters_lock:
            if self._shared_adapters is None or self._shared_adapters.store is not store:
                named = self.settings.adapter_registry_dir
                folder = Path(named) if named else Path(tempfile.mkdtemp(prefix="llm-adapters-"))
                self._shared_adapters = SharedAdapters(store, self.settings, folder)
            return self._shared_adapters

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

    def _on_parts(self, parts: PromptParts, path: str, reason: str) -> str | None:
        """The backend has loaded (on its thread): what the prompt layer renders with, and which path serves.
        Returns the reasoning format the renderer uses (vLLM's engine gates structured outputs by it)."""
        self.renderer = self._renderer(parts.tokenizer, parts.vision)
        self.engine_path = path
        metrics.record_engine_path(path, reason)
        return self.renderer.reasoning_parser

    def _renderer(self, tokenizer, encoder) -> PromptRenderer:
        settings = self.settings
        if encoder is None:
            return PromptRenderer(tokenizer, settings.tool_call_parser, settings.reasoning_parser)
        return VisionRenderer(tokenizer, settings.tool_call_parser, encoder, image_loader(settings),
                              settings.max_images_per_request, settings.reasoning_parser)
