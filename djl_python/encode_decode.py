"""LMI's ``djl_python.encode_decode``: a request body decoded, and a prediction encoded, by content type.

The same choices as LMI's module (djl-serving ``engines/python/setup/djl_python/encode_decode.py``): JSON, CSV with a
header row (``inputs``, ``question`` or ``context``), plain text as ``{"inputs": [text]}``, images, audio and
numpy arrays. Two differ, because LMI's answer there is DJL's Java NDList encoding, which no HTTP client reads:
``encode`` writes ``text/plain`` as text, ``*/*`` as JSON, and refuses a content type it has no encoding for, in
one line.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable

from handler.djl import Input, Output

_CSV_HEADERS = ("question", "context", "inputs")


def decode_csv(inputs: Input, require_headers: bool = True) -> object:
    """Rows with a header naming ``inputs`` (their values as a list) or ``question``/``context`` (the rows as
    dicts); without headers, numbers only, as a numpy array."""
    text = inputs.get_as_string()
    if not require_headers:
        import numpy

        values = numpy.genfromtxt(io.StringIO(text), delimiter=",")
        if numpy.isnan(values).any():
            raise ValueError("CSV contains non-numeric data. Please provide numeric data only.")
        return values
    first_line = text.splitlines()[0].lower() if text else ""
    if not any(header in first_line for header in _CSV_HEADERS):
        raise ValueError(f"text/csv needs a header row naming one of {', '.join(_CSV_HEADERS)}")
    rows = list(csv.DictReader(io.StringIO(text)))
    return {"inputs": [row["inputs"] for row in rows]} if rows and "inputs" in rows[0] else {"inputs": rows}


def encode_csv(content: object) -> str:
    """Dicts (one per row, the first one's keys as the header) as CSV text."""
    rows = content if isinstance(content, list) else list(content)
    stream = io.StringIO()
    writer = csv.DictWriter(stream, rows[0].keys())
    writer.writeheader()
    writer.writerows(rows)
    return stream.getvalue()


def _npy(inputs: Input, key: str | None) -> list:
    import numpy

    return [numpy.load(io.BytesIO(inputs.get_as_bytes(key)))]


def _decoders(require_csv_headers: bool) -> list[tuple[Callable[[str], bool], Callable[[Input, str | None], object]]]:
    """(does this content type match, how to read the body), first match wins: LMI's order."""
    return [
        (lambda t: "application/json" in t, lambda i, k: i.get_as_json(k)),
        (lambda t: "text/csv" in t, lambda i, k: decode_csv(i, require_headers=require_csv_headers)),
        (lambda t: "text/plain" in t, lambda i, k: {"inputs": [i.get_as_string(k)]}),
        (lambda t: t.startswith("image/"), lambda i, k: {"inputs": i.get_as_image(k)}),
        (lambda t: t.startswith("audio/"), lambda i, k: {"inputs": i.get_as_bytes(k)}),
        (lambda t: "tensor/npz" in t, lambda i, k: {"inputs": i.get_as_npz(k)}),
        (lambda t: t == "tensor/ndlist", lambda i, k: {"inputs": i.get_as_numpy(k)}),
        (lambda t: t == "application/x-npy", lambda i, k: {"inputs": _npy(i, k)}),
        (lambda t: t == "application/x-www-form-urlencoded", lambda i, k: {"inputs": i.get_as_string(k)}),
    ]


def decode(inputs: Input, content_type: str | None, key: str | None = None,
           require_csv_headers: bool = True) -> object:
    """The body as LMI hands it to a handler: no content type reads JSON (an empty body is ``{"inputs": ""}``);
    anything unknown is ``{"inputs": bytes}`` (application/octet-stream)."""
    if not content_type:
        return inputs.get_as_json(key) if inputs.get_as_bytes(key) else {"inputs": ""}
    for matches, read in _decoders(require_csv_headers):
        if matches(content_type):
            return read(inputs, key)
    return {"inputs": inputs.get_as_bytes(key)}


def encode(outputs: Output, prediction: object, content_type: str | None, key: str | None = None) -> None:
    """Add ``prediction`` to ``outputs`` in ``content_type`` (JSON when none), with the Content-Type header."""
    if not content_type or "application/json" in content_type:
        outputs.add_as_json(prediction, key=key)
        content_type = "application/json"
    elif "text/csv" in content_type:
        outputs.add_as_string(encode_csv(prediction), key=key)
        content_type = "text/csv"
    elif "text/plain" in content_type:
        outputs.add_as_string(str(prediction), key=key)
        content_type = "text/plain"
    elif "tensor/npz" in content_type:
        outputs.add_as_npz(prediction, key=key)
        content_type = "tensor/npz"
    elif "*/*" in content_type:  # an Accept header that takes anything (requests and curl send */*): JSON
        outputs.add_as_json(prediction, key=key)
        content_type = "application/json"
    else:
        raise ValueError(f"cannot encode a prediction as {content_type!r}: use application/json, text/csv, "
                         "text/plain or tensor/npz")
    outputs.add_property("Content-Type", content_type)
