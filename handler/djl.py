"""A djl-python-style handler contract, so LMI users can bring their ``model.py`` unchanged in spirit.

A model directory (or ``option.entryPoint``: a file path or a module name) may provide a module with
``handle(inputs: Input) -> Output | None``. Then /invocations goes through it. As in LMI, the first call is an
empty initialisation call (``inputs.is_empty()`` is true; ``inputs.get_properties()`` holds the settings), made
once at start before /ping answers 200. ``builtin_handle(inputs)`` runs the built-in handler (both schemas,
streaming included), so a user handler can wrap it. Errors inside the user's handler become a 500 naming the
handler; the worker keeps serving.

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

import importlib
import importlib.util
import json
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType

_builtin: Callable[[Input], Output] | None = None


class Input:
    """One request as the handler sees it: body, content type, headers and the server's properties."""

    def __init__(self, body: bytes = b"", content_type: str = "", headers: dict[str, str] | None = None,
                 properties: dict[str, str] | None = None) -> None:
        self._body = body
        self.content_type = content_type
        self.headers = dict(headers or {})
        self._properties = dict(properties or {})

    def is_empty(self) -> bool:
        return not self._body

    def get_as_bytes(self) -> bytes:
        return self._body

    def get_as_string(self) -> str:
        return self._body.decode("utf-8")

    def get_as_json(self) -> object:
        return json.loads(self._body)

    def get_properties(self) -> dict[str, str]:
        return dict(self._properties)

    def get_property(self, key: str) -> str | None:
        lowered = {k.lower(): v for k, v in self.headers.items()}
        return self._properties.get(key, lowered.get(key.lower()))

    def get_content_type(self) -> str:
        return self.content_type


class Output:
    """What the handler answers: a status, headers (``add_property``) and a body, or a stream of chunks."""

    def __init__(self, code: int = 200, message: str = "OK") -> None:
        self.code, self.message = code, message
        self.properties: dict[str, str] = {}
        self.body: bytes = b""
        self.stream: Iterable[bytes] | None = None

    def set_code(self, code: int) -> Output:
        self.code = code
        return self

    def set_message(self, message: str) -> Output:
        self.message = message
        return self

    def add_property(self, key: str, value: str) -> Output:
        self.properties[key] = value
        return self

    def add(self, value: bytes | str | object) -> Output:
        """Set the body: bytes as they are, a string as UTF-8, anything else as JSON."""
        if isinstance(value, bytes):
            self.body = value
        elif isinstance(value, str):
            self.body = value.encode("utf-8")
        else:
            return self.add_as_json(value)
        return self

    def add_as_json(self, value: object) -> Output:
        self.body = json.dumps(value, ensure_ascii=False).encode("utf-8")
        self.properties.setdefault("Content-Type", "application/json")
        return self

    def add_stream_content(self, chunks: Iterable[bytes | str], content_type: str = "application/jsonlines") -> Output:
        """Stream the body: each chunk is sent as it is produced (JSON lines should end with a newline)."""
        self.stream = (c.encode("utf-8") if isinstance(c, str) else c for c in chunks)
        self.properties.setdefault("Content-Type", content_type)
        return self

    def get_as_bytes(self) -> bytes:
        """The whole body (a stream is read to its end)."""
        if self.stream is not None:
            self.body, self.stream = b"".join(self.stream), None
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
    """``option.entryPoint`` when set, else ``model.py`` in the model directory when it exists."""
    if entry_point:
        return entry_point
    candidate = model_dir / "model.py"
    return str(candidate) if candidate.is_file() else None


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


def calls_builtin(module: ModuleType) -> bool:
    """Whether the handler's module can reach ``builtin_handle``: it imported the function, or this module (also
    as ``import handler.djl``)."""
    reachable = (builtin_handle, sys.modules[__name__], sys.modules["handler"])
    return any(any(value is r for r in reachable) for value in vars(module).values())


class UserHandler:
    """The user's ``handle``, initialised once, called per request."""

    def __init__(self, entry_point: str, properties: dict[str, str]) -> None:
        self.name = entry_point
        module = load_module(entry_point)
        handle = getattr(module, "handle", None)
        if not callable(handle):
            raise AttributeError(f"{entry_point} has no handle(inputs) function")
        self.calls_builtin = calls_builtin(module)
        self._handle = handle
        self._properties = properties
        self._initialised = threading.Event()

    @property
    def is_initialised(self) -> bool:
        return self._initialised.is_set()

    def initialise(self) -> None:
        self._handle(Input(properties=self._properties))
        self._initialised.set()

    def __call__(self, inputs: Input) -> Output:
        output = self._handle(inputs)
        return output if isinstance(output, Output) else Output().add(b"" if output is None else output)
