"""Loading a user's handler: which module serves (``find_entry_point``: ``option.entryPoint``, else ``model.py`` in
the model folder), importing it (``load_handle``; any failure one ``HandlerLoadError`` line), whether it can reach
the built-in handler (``calls_builtin``: then the built-in engine loads), and calling it (``UserHandler``: LMI's
empty initialisation call first, ``async def handle`` on one event loop of its own).

May import: ``handler.config``, ``handler.errors``, ``handler.djl.types`` and ``handler.djl.builtin``.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from handler.config import LMI_ENTRY_POINTS
from handler.djl.builtin import builtin_handle
from handler.djl.types import Input, Output
from handler.errors import ConfigError


class HandlerLoadError(Exception):
    """The user's handler cannot be loaded (import error, syntax error, no ``handle``): one line for the console."""


def find_entry_point(model_dir: Path, entry_point: str | None) -> str | None:
    """``option.entryPoint`` when set, else ``model.py`` in the model directory when it exists; None when LMI's
    built-in handler is named (ours serves, and a ``model.py`` beside it is not used, as in LMI). A relative ``.py``
    path names a file in the model directory (LMI's rule), else one relative to the working directory; a ``.py``
    file that is in neither is a ``ConfigError``, so the start stops in the master with one line."""
    if entry_point in LMI_ENTRY_POINTS:
        return None
    if not entry_point:
        candidate = model_dir / "model.py"
        return str(candidate) if candidate.is_file() else None
    if not entry_point.endswith(".py"):
        return entry_point  # a module name: the worker imports it
    for candidate in (model_dir / entry_point, Path(entry_point)):
        if candidate.is_file():
            return str(candidate)
    raise ConfigError(f"option.entryPoint={entry_point!r}: no such file in {model_dir} (or the working directory)")


def load_module(entry_point: str) -> ModuleType:
    """A file path (``/opt/ml/model/model.py``) or an importable module name (``my_package.handler``)."""
    if entry_point.endswith(".py"):
        path = Path(entry_point)
        spec = importlib.util.spec_from_file_location(f"user_handler_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {entry_point}")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))  # its own helper modules import as they would under LMI
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(entry_point)


def load_handle(entry_point: str) -> tuple[Callable, ModuleType]:
    """The module's ``handle``; any failure is one ``HandlerLoadError`` line naming the file and the error (the
    traceback stays on the exception's cause, for debug logs)."""
    try:
        module = load_module(entry_point)
    except Exception as error:
        raise HandlerLoadError(f"the custom handler {entry_point} failed to load: "
                               f"{type(error).__name__}: {error}") from error
    handle = getattr(module, "handle", None)
    if not callable(handle):
        raise HandlerLoadError(f"the custom handler {entry_point} has no handle(inputs) function")
    return handle, module


def calls_builtin(module: ModuleType) -> bool:
    """Whether the handler's module can reach ``builtin_handle``: it imported the function, or ``handler.djl``
    (also as ``import handler.djl``)."""
    reachable = (builtin_handle, sys.modules["handler.djl"], sys.modules["handler"])
    return any(any(value is r for r in reachable) for value in vars(module).values())


class _EventLoop:
    """One event loop on its own thread for an ``async def handle``: LMI's async handlers keep state bound to their
    loop (an async engine, its queues), so every call must run on the same one."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="handler-loop", daemon=True).start()

    def run(self, awaitable) -> object:
        return asyncio.run_coroutine_threadsafe(awaitable, self.loop).result()


class UserHandler:
    """The user's ``handle``, initialised once, called per request."""

    def __init__(self, entry_point: str, properties: dict[str, str]) -> None:
        self.name = entry_point
        self._handle, module = load_handle(entry_point)
        self.calls_builtin = calls_builtin(module)
        self._properties = properties
        self._initialised = threading.Event()
        self._loop: _EventLoop | None = None
        self._loop_lock = threading.Lock()

    @property
    def is_initialised(self) -> bool:
        return self._initialised.is_set()

    def initialise(self) -> None:
        self._call(Input(properties=self._properties))
        self._initialised.set()

    def _call(self, inputs: Input) -> object:
        result = self._handle(inputs)
        if not inspect.isawaitable(result):
            return result
        with self._loop_lock:
            self._loop = self._loop or _EventLoop()
        return self._loop.run(result)

    def __call__(self, inputs: Input) -> Output:
        output = self._call(inputs)
        return output if isinstance(output, Output) else Output().add(b"" if output is None else output)
