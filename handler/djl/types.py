"""LMI's handler types with LMI's own method names and meanings (djl-serving's ``djl_python/inputs.py``,
``outputs.py`` and ``pair_list.py``): ``Input`` is one request as a user's ``handle`` sees it, ``Output`` its
answer (a body, or a stream of chunks), ``PairList`` the named parts of either.

May import: the standard library (numpy and PIL only inside the methods that decode them).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Iterator


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
