"""A djl-python-style handler contract, so LMI users can bring their ``model.py`` unchanged.

A model directory (or ``option.entryPoint``: a file path, relative to the model directory as in LMI, or a module
name) may provide a module with ``handle(inputs: Input) -> Output | None`` (or ``async def handle``). Then
/invocations goes through it. As in LMI, the first call is an empty initialisation call (``inputs.is_empty()`` is
true; ``inputs.get_properties()`` holds the settings), made once at start before /ping answers 200.
``builtin_handle(inputs)`` runs the built-in handler (both schemas, streaming included), so a user handler can wrap
it. Errors inside the user's handler become a 500 naming the handler; the worker keeps serving. A handler that
cannot be loaded stops the start with one line (``HandlerLoadError``).

``Input`` and ``Output`` carry LMI's own method names and meanings (djl-serving's ``djl_python/inputs.py`` and
``outputs.py``); the ``djl_python`` package at the repository root re-exports them, so ``from djl_python import
Input, Output`` works as it does in LMI.

The built-in engine loads only when the handler asks for it: when its module imports ``builtin_handle`` (or the
``handler.djl`` module), or when ``option.builtin_engine=true``. A handler that runs its own model starts without
loading anything of ours, so it can serve any architecture, or a folder with no ``config.json`` at all.

    from handler.djl import Input, Output, builtin_handle

    def handle(inputs: Input) -> Output | None:
        if inputs.is_empty():
            return None                      # initialisation call
        output = builtin_handle(inputs)
        return Output().add_as_json({"upper": output.get_as_json()["generated_text"].upper()})
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import io
import json
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType

from handler.config import LMI_ENTRY_POINTS
from handler.errors import ConfigError

_builtin: Callable[[Input], Output] | None = None


class HandlerLoadError(Exception):
    """The user's handler cannot be loaded (import error, syntax error, no ``handle``): one line for the console."""


class PairList:
    """LMI's ordered key/value list: the named parts of a request or an answer (keys may repeat or be None)."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []
        self.values: list = []

    def add(self, key: str | None = None, value: object = None) -> None:
        if value is not None:  # LMI ignores a None value
            self.keys.append(key)
            self.values.append(value)

    def size(self) -> int:
        return len(self.keys)

    def is_empty(self) -> bool:
        return not self.keys

    def get(self, key: str | None) -> object:
        return self.values[self.keys.index(key)] if key in self.keys else None

    def key_at(self, index: int) -> str | None:
        return self.keys[index]

    def value_at(self, index: int) -> object:
        return self.values[index]

    def get_keys(self) -> list[str | None]:
        return self.keys

    def get_values(self) -> list:
        return self.values


def _batch_key(key: str) -> tuple[int, str] | None:
    """LMI's batched names: ``batch_003_inputs`` -> (3, "inputs")."""
    if key.startswith("batch_") and key != "batch_size" and key[6:9].isdigit():
        return int(key[6:9]), key[10:]
    return None


class Input:
    """One request as the handler sees it. ``properties``: the server's settings (as LMI hands them over) and the
    request's headers; ``content``: the body under the key ``data``."""

    def __init__(self, body: bytes = b"", content_type: str = "", headers: dict[str, str] | None = None,
                 properties: dict[str, str] | None = None) -> None:
        self.headers = dict(headers or {})
        self.properties: dict[str, str] = {**(properties or {}), **self.headers}
        self.content = PairList()
        self.content.add("data", body or None)
        self.content_type = content_type
        if content_type and self.get_property("content-type") is None:
            self.properties["Content-Type"] = content_type  # LMI handlers read it as a property
        self.function_name: str | None = None

    def is_empty(self) -> bool:
        return self.content.is_empty()

    def is_batch(self) -> bool:
        return "batch_size" in self.properties

    def get_batch_size(self) -> int:
        return int(self.properties.get("batch_size", "1"))

    def get_batches(self) -> list[Input]:
        """The requests of a batch (LMI's ``batch_NNN_`` names), or this one alone: this server never batches
        requests into one call, so handlers written for LMI's batching see a batch of one."""
        if not self.is_batch():
            return [self]
        batch = [Input() for _ in range(self.get_batch_size())]
        for key, value in self.properties.items():
            if (found := _batch_key(key)) is not None:
                batch[found[0]].properties[found[1]] = value
        for key, value in zip(self.content.keys, self.content.values, strict=True):
            if key is not None and (found := _batch_key(key)) is not None:
                batch[found[0]].content.add(found[1], value)
        return batch

    def get_function_name(self) -> str | None:
        return self.function_name

    def get_properties(self) -> dict[str, str]:
        return self.properties

    def get_property(self, key: str) -> str | None:
        """A setting or a header, by name in any case (LMI's rule)."""
        return next((v for k, v in self.properties.items() if k.lower() == key.lower()), None)

    def get_content_type(self) -> str:
        return self.content_type or self.get_property("content-type") or ""

    def get_content(self) -> PairList:
        return self.content

    def contains_key(self, key: str) -> bool:
        return self.content.get(key) is not None

    def get_data(self, key: str | None = None) -> object:
        """The body decoded by its content type, as LMI does: JSON, text, an image, numpy arrays, else bytes."""
        content_type = self.get_content_type()
        if content_type == "tensor/npz":
            return self.get_as_npz(key)
        if content_type == "tensor/ndlist":
            return self.get_as_numpy(key)
        for prefix, read in (("application/json", self.get_as_json), ("text/", self.get_as_string),
                             ("image/", self.get_as_image)):
            if content_type.startswith(prefix):
                return read(key)
        return None if self.is_empty() else self.get_as_bytes(key)

    def get_as_bytes(self, key: str | None = None) -> bytes:
        """The part named ``key``, else the ``data`` part, else the first; empty bytes for an empty input."""
        if key:
            value = self.content.get(key)
            if value is None:
                raise KeyError(f"requested data for key:{key} is not found!")
            return value
        if self.is_empty():
            return b""
        value = self.content.get("data")
        return self.content.value_at(0) if value is None else value

    def get_as_string(self, key: str | None = None) -> str:
        return bytes(self.get_as_bytes(key)).decode("utf-8")

    def get_as_json(self, key: str | None = None) -> object:
        return json.loads(self.get_as_bytes(key))

    def get_as_image(self, key: str | None = None):
        from PIL import Image

        return Image.open(io.BytesIO(self.get_as_bytes(key)))

    def get_as_npz(self, key: str | None = None) -> list:
        import numpy

        arrays = numpy.load(io.BytesIO(self.get_as_bytes(key)))
        return [arrays[name] for name in arrays.files]

    def get_as_numpy(self, key: str | None = None) -> list:
        raise ValueError("tensor/ndlist (DJL's Java NDList encoding) is not read here; send tensor/npz")

    def get_as_csv(self, key: str | None = None) -> list[dict[str, str]]:
        import csv

        return list(csv.DictReader(io.StringIO(self.get_as_string(key))))


def _json_default(value: object) -> object:
    """What ``json`` cannot write and handlers return: numpy scalars and arrays, datetimes (as LMI writes them)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "isoformat"):
        return str(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def encode_json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, default=_json_default).encode("utf-8")


def _as_bytes(value: object) -> bytes:
    """A stream chunk or a body part: bytes as they are, a string as UTF-8, anything else as JSON."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    return value.encode("utf-8") if isinstance(value, str) else encode_json(value)


class Output:
    """What the handler answers: a status, headers (``add_property``) and a body, or a stream of chunks. The body is
    the part named ``data``, else the first part added (LMI's Java front end answers the same way)."""

    def __init__(self, code: int = 200, message: str = "OK") -> None:
        self.code, self.message = code, message
        self.properties: dict[str, str] = {}
        self.content = PairList()
        self.stream: Iterable[bytes] | None = None

    def set_code(self, code: int) -> Output:
        self.code = code
        return self

    def set_message(self, message: str) -> Output:
        self.message = message
        return self

    def error(self, error: str, code: int = 424, message: str = "invoke handler failure") -> Output:
        """LMI's error answer: the status and a JSON body ``{"code", "message", "error"}``."""
        self.code, self.message = code, message
        self.add_property("Content-Type", "application/json")
        return self.add_as_json({"code": code, "message": message, "error": error})

    def add_property(self, key: str, value: str) -> Output:
        """A header; one per name whatever its case (LMI handlers write ``content-type``, we ``Content-Type``)."""
        for existing in [k for k in self.properties if k.lower() == key.lower()]:
            del self.properties[existing]
        self.properties[key] = value
        return self

    def get_properties(self) -> dict[str, str]:
        return self.properties

    def get_property(self, key: str) -> str | None:
        return next((v for k, v in self.properties.items() if k.lower() == key.lower()), None)

    def add(self, value: object, key: str | None = None, batch_index: int | None = None) -> Output:
        """Add a body part: bytes as they are, a string as UTF-8, anything else as JSON."""
        if batch_index is not None:
            key = f"batch_{batch_index}.{key or ''}"
        self.content.add(None if key is None else str(key), _as_bytes(value))
        return self

    def add_as_json(self, value: object, key: str | None = None, batch_index: int | None = None) -> Output:
        if self.get_property("content-type") is None:
            self.add_property("Content-Type", "application/json")
        return self.add(encode_json(value), key, batch_index)

    def add_as_string(self, value: str, key: str | None = None, batch_index: int | None = None) -> Output:
        return self.add(str(value), key, batch_index)

    def add_as_npz(self, arrays: list, key: str | None = None, batch_index: int | None = None) -> Output:
        import numpy

        buffer = io.BytesIO()
        numpy.savez(buffer, *arrays)
        return self.add(buffer.getvalue(), key, batch_index)

    def add_stream_content(self, chunks: Iterable[object], content_type: str = "application/jsonlines",
                           formatter: Callable[[object], object] | None = None) -> Output:
        """Stream the body: each chunk is sent as it is produced (JSON lines should end with a newline), through
        ``formatter`` first when given."""
        shape = formatter or (lambda chunk: chunk)
        self.stream = (_as_bytes(shape(chunk)) for chunk in chunks)
        if self.get_property("content-type") is None:
            self.add_property("Content-Type", content_type)
        return self

    @property
    def body(self) -> bytes:
        if self.content.is_empty():
            return b""
        value = self.content.get("data")
        return self.content.value_at(0) if value is None else value

    def get_as_bytes(self) -> bytes:
        """The whole body (a stream is read to its end)."""
        if self.stream is not None:
            whole, self.content, self.stream = b"".join(self.stream), PairList(), None
            self.content.add("data", whole)
        return self.body

    def get_as_json(self) -> object:
        return json.loads(self.get_as_bytes())

    def iter_body(self) -> Iterator[bytes]:
        yield from (self.stream if self.stream is not None else [self.body])


def builtin_handle(inputs: Input) -> Output:
    """The built-in handler (both schemas), for a user's handler to call."""
    if _builtin is None:
        raise RuntimeError("the built-in handler is not running in this process")
    return _builtin(inputs)


def set_builtin(handle: Callable[[Input], Output]) -> None:
    global _builtin
    _builtin = handle


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
    """Whether the handler's module can reach ``builtin_handle``: it imported the function, or this module (also
    as ``import handler.djl``)."""
    reachable = (builtin_handle, sys.modules[__name__], sys.modules["handler"])
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
