"""Turn an image reference from a chat content part into an RGB ``PIL.Image.Image``.

A reference is an ``http(s)://`` URL (fetched by :mod:`handler.images.fetch`, under the SSRF rules of
:mod:`handler.images.policy`), a ``data:image/<fmt>;base64,...`` URI, or bare base64 (as LMI accepts). Anything
else is a 400 naming the field.

The bytes are the only truth: the format is sniffed by Pillow from the data, never taken from a data URI's
declared type or a Content-Type, and only common raster formats are opened (Pillow's rarer plugins, EPS with
its Ghostscript call above all, are not attack surface worth offering). The pixel count is checked from the
header before anything is decoded: a PNG of a few kilobytes can claim 30000x30000 pixels, 2.7 GB as RGB.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import io
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from PIL import Image, ImageOps

from handler.errors import BadRequest
from handler.images.fetch import fetch_image_bytes
from handler.images.policy import FetchPolicy

# Formats Image.open may pick (phone JPEGs that are really MPO come in through JPEG).
_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Refuse images over ``max_pixels`` (checked from the header) or ``max_bytes`` (encoded size)."""

    max_pixels: int = 40_000_000
    max_bytes: int = 20 * 1024 * 1024


def load_image(ref: str, policy: FetchPolicy, limits: DecodeLimits, *, param: str) -> Image.Image:
    """The RGB image ``ref`` (URL, data URI or bare base64) refers to; every failure is a 400 naming ``param``."""
    data = inline_bytes(ref, limits, param=param)
    if data is None:
        data = fetch_image_bytes(ref.strip(), fetch_policy(policy, limits), param=param)
    return decode_image_bytes(data, limits, param=param)


def fetch_policy(policy: FetchPolicy, limits: DecodeLimits) -> FetchPolicy:
    """``policy`` with its byte cap no larger than the decoder's."""
    return dataclasses.replace(policy, max_bytes=min(policy.max_bytes, limits.max_bytes))


def inline_bytes(ref: str, limits: DecodeLimits, *, param: str) -> bytes | None:
    """The bytes of a data: URI or bare base64 ``ref``; None for an http(s) URL (the caller fetches it). Any other
    reference is a 400 naming ``param``."""
    if not isinstance(ref, str) or not ref.strip():
        raise BadRequest(f"{param} must be an image URL, a data: URI or base64 data", param=param)
    text = ref.strip()
    match = _SCHEME.match(text)
    scheme = match.group(1).lower() if match else None
    if scheme in ("http", "https"):
        return None
    if scheme == "data":
        return _decode_base64(_data_uri_payload(text, param), limits, param)
    if scheme is not None:
        raise BadRequest(
            f"{param}: '{scheme}:' references are not supported; use an http(s) URL, a data: URI or base64 data",
            param=param,
        )
    return _decode_base64(text, limits, param)


def image_size(data: bytes, limits: DecodeLimits, *, param: str) -> tuple[int, int]:
    """``(width, height)`` from the header alone (nothing is decoded), after the same checks as decoding: size,
    format, ``limits.max_pixels``. What a request's images will take is known before any of them is decoded."""
    with _opened(data, limits, param) as img:
        return img.size


def _check_bytes(data: bytes, limits: DecodeLimits, param: str) -> None:
    if len(data) > limits.max_bytes:
        raise BadRequest(
            f"image in {param} is {len(data)} bytes, over the limit of {limits.max_bytes} bytes", param=param
        )
    if not data:
        raise BadRequest(f"image in {param} is empty", param=param)


def decode_image_bytes(data: bytes, limits: DecodeLimits, *, param: str) -> Image.Image:
    """Decode ``data`` (format sniffed) to RGB: first frame, EXIF orientation applied, alpha over white."""
    with _opened(data, limits, param) as img:
        img.seek(0)
        img.load()
        return _to_rgb(img)


@contextlib.contextmanager
def _opened(data: bytes, limits: DecodeLimits, param: str) -> Iterator[Image.Image]:
    """The image opened from its header (format sniffed, size and pixel count checked, nothing decoded yet); what
    Pillow raises while the caller reads it becomes a 400 naming ``param``."""
    _check_bytes(data, limits, param)
    # catch_warnings is process-wide, not per thread; the header check in _check_pixels does not depend on it.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=_FORMATS) as img:
                _check_pixels(img, limits, param)
                yield img
        except BadRequest:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise BadRequest(f"image in {param} has too many pixels: {exc}", param=param) from exc
        except Exception as exc:  # Pillow raises many types on hostile input: OSError, ValueError, SyntaxError...
            raise BadRequest(f"{param} is not a decodable image: {exc}", param=param) from exc


def _check_pixels(img: Image.Image, limits: DecodeLimits, param: str) -> None:
    """Refuse from the header's size alone, before a single pixel is decoded."""
    width, height = img.size
    if width * height > limits.max_pixels:
        raise BadRequest(
            f"image in {param} is {width}x{height} = {width * height} pixels, over the limit of "
            f"{limits.max_pixels} pixels",
            param=param,
        )


def _data_uri_payload(text: str, param: str) -> str:
    """The base64 part of ``data:<type>;base64,<payload>``; the declared type is ignored (bytes are sniffed)."""
    header, comma, payload = text[len("data:"):].partition(",")
    if not comma:
        raise BadRequest(f"{param} is not a valid data: URI (no ',')", param=param)
    params = [item.strip().lower() for item in header.split(";")[1:]]
    if "base64" not in params:
        raise BadRequest(f"{param}: data: URI must be base64-encoded (data:image/<format>;base64,...)", param=param)
    return payload


def _decode_base64(text: str, limits: DecodeLimits, param: str) -> bytes:
    """Strict base64 (whitespace ignored, missing padding tolerated), size checked before decoding."""
    compact = "".join(text.split())
    if len(compact) > 4 * -(-limits.max_bytes // 3):
        raise BadRequest(f"image in {param} is over the limit of {limits.max_bytes} bytes", param=param)
    compact += "=" * (-len(compact) % 4)
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{param} is not valid base64 image data: invalid base64 ({exc})", param=param) from exc


def _to_rgb(img: Image.Image) -> Image.Image:
    """A new RGB image: EXIF orientation applied, deep greys scaled to 8 bits, transparency over white."""
    ImageOps.exif_transpose(img, in_place=True)
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        img = _to_8bit_grey(img)
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _to_8bit_grey(img: Image.Image) -> Image.Image:
    """Mode L from 16/32-bit integer or float greys (Pillow's own conversion clips instead of scaling)."""
    if img.mode == "F":
        scale = 255.0 if img.getextrema()[1] <= 1.0 else 1.0
    else:
        sixteen_bit = img.mode.startswith("I;16") or img.getextrema()[1] > 255
        img = img.convert("I")
        scale = 1 / 256 if sixteen_bit else 1.0
    return img.point(lambda value: value * scale).convert("L")
