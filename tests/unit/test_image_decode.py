"""handler.images.decode: references (URL, data URI, bare base64) to RGB images, and what is refused."""

from __future__ import annotations

import base64
import io
import socket
import struct
import zlib

import pytest
from PIL import Image, ImageFile

from handler.errors import BadRequest
from handler.images import DecodeLimits, FetchPolicy, decode_image_bytes, load_image
from handler.images import decode as decode_module

PARAM = "messages[2].content[1].image_url.url"
LIMITS = DecodeLimits()
POLICY = FetchPolicy()


def encode(img: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def close(pixel: tuple[int, ...], expected: tuple[int, int, int], tolerance: int = 8) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, expected, strict=True))


def png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def crafted_png(width: int, height: int, idat: bytes = b"") -> bytes:
    """A 1-bit greyscale PNG claiming width x height; ``idat`` is the raw (filter byte + bits) scanline data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(idat, 9))
        + png_chunk(b"IEND", b"")
    )


@pytest.fixture()
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Records every full decode (ImageFile.load), to prove a refusal came from the header alone."""
    calls: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def load(self: ImageFile.ImageFile) -> object:
        calls.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls


@pytest.fixture()
def no_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    def fetch(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("fetch_image_bytes must not be called")

    monkeypatch.setattr(decode_module, "fetch_image_bytes", fetch)


# --- formats and modes ---------------------------------------------------------------------------------

RED, BLUE = (220, 20, 30), (20, 40, 210)


@pytest.mark.parametrize(
    ("fmt", "kwargs"),
    [("PNG", {}), ("JPEG", {"quality": 95}), ("WEBP", {"lossless": True}), ("GIF", {}), ("BMP", {}), ("TIFF", {})],
)
def test_formats_decode_to_rgb(fmt: str, kwargs: dict[str, object]) -> None:
    data = encode(Image.new("RGB", (33, 17), RED), fmt, **kwargs)
    img = decode_image_bytes(data, LIMITS, param=PARAM)
    assert img.mode == "RGB"
    assert img.size == (33, 17)
    assert close(img.getpixel((16, 8)), RED, tolerance=12)


@pytest.mark.parametrize(("fmt", "kwargs"), [("GIF", {}), ("WEBP", {"lossless": True}), ("PNG", {})])
def test_animated_images_give_the_first_frame(fmt: str, kwargs: dict[str, object]) -> None:
    first, second = Image.new("RGB", (8, 6), RED), Image.new("RGB", (8, 6), BLUE)
    data = encode(first, fmt, save_all=True, append_images=[second], duration=100, loop=0, **kwargs)
    with Image.open(io.BytesIO(data)) as check:
        assert getattr(check, "n_frames", 1) == 2  # really animated
    img = decode_image_bytes(data, LIMITS, param=PARAM)
    assert img.mode == "RGB" and img.size == (8, 6)
    assert close(img.getpixel((3, 3)), RED, tolerance=12)


def test_rgba_is_composited_over_white() -> None:
    rgba = Image.new("RGBA", (3, 1))
    rgba.putpixel((0, 0), (255, 0, 0, 0))  # fully transparent red: white
    rgba.putpixel((1, 0), (0, 0, 255, 255))  # opaque blue: blue
    rgba.putpixel((2, 0), (0, 0, 0, 128))  # half-transparent black: mid grey
    img = decode_image_bytes(encode(rgba, "PNG"), LIMITS, param=PARAM)
    assert img.mode == "RGB"
    assert img.getpixel((0, 0)) == (255, 255, 255)
    assert img.getpixel((1, 0)) == (0, 0, 255)
    assert close(img.getpixel((2, 0)), (127, 127, 127), tolerance=2)


def test_palette_with_transparency_is_composited_over_white() -> None:
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
    pal.putpixel((0, 0), 0)
    pal.putpixel((1, 0), 1)
    pal.info["transparency"] = 0
    img = decode_image_bytes(encode(pal, "PNG", transparency=0), LIMITS, param=PARAM)
    assert img.mode == "RGB"
    assert img.getpixel((0, 0)) == (255, 255, 255)
    assert img.getpixel((1, 0)) == (0, 200, 0)


def test_palette_without_transparency() -> None:
    pal = Image.new("RGB", (4, 4), BLUE).convert("P", palette=Image.Palette.ADAPTIVE)
    img = decode_image_bytes(encode(pal, "PNG"), LIMITS, param=PARAM)
    assert img.mode == "RGB" and img.getpixel((1, 1)) == BLUE


def test_la_cmyk_bilevel_and_16_bit_grey() -> None:
    la = decode_image_bytes(encode(Image.new("LA", (2, 2), (50, 255)), "PNG"), LIMITS, param=PARAM)
    assert la.mode == "RGB" and la.getpixel((0, 0)) == (50, 50, 50)
    cmyk = decode_image_bytes(encode(Image.new("CMYK", (4, 4), (0, 255, 255, 0)), "JPEG"), LIMITS, param=PARAM)
    assert cmyk.mode == "RGB" and close(cmyk.getpixel((1, 1)), (255, 0, 0), tolerance=12)
    bilevel = decode_image_bytes(encode(Image.new("1", (9, 3), 1), "PNG"), LIMITS, param=PARAM)
    assert bilevel.mode == "RGB" and bilevel.getpixel((0, 0)) == (255, 255, 255)
    deep = Image.new("I;16", (2, 2), 40000)
    deep_png = encode(deep, "PNG")
    with Image.open(io.BytesIO(deep_png)) as check:
        assert check.mode.startswith("I")
    grey = decode_image_bytes(deep_png, LIMITS, param=PARAM)
    assert grey.mode == "RGB" and close(grey.getpixel((0, 0)), (156, 156, 156), tolerance=1)  # 40000/256, not clipped


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(Image.new("RGB", (40, 20), RED), "JPEG", exif=exif)
    img = decode_image_bytes(data, LIMITS, param=PARAM)
    assert img.size == (20, 40)


def test_result_is_independent_of_the_input_buffer() -> None:
    img = decode_image_bytes(encode(Image.new("RGB", (5, 5), RED), "PNG"), LIMITS, param=PARAM)
    assert img.getpixel((4, 4)) == RED
    assert getattr(img, "fp", None) is None


# --- references ----------------------------------------------------------------------------------------


def test_data_uri_decodes(no_fetch: None) -> None:
    data = encode(Image.new("RGB", (6, 4), BLUE), "PNG")
    img = load_image(f"data:image/png;base64,{b64(data)}", POLICY, LIMITS, param=PARAM)
    assert img.mode == "RGB" and img.size == (6, 4) and img.getpixel((0, 0)) == BLUE


def test_data_uri_with_lying_type_is_sniffed(no_fetch: None) -> None:
    jpeg = encode(Image.new("RGB", (10, 7), RED), "JPEG")
    img = load_image(f"data:image/png;base64,{b64(jpeg)}", POLICY, LIMITS, param=PARAM)
    assert img.size == (10, 7) and close(img.getpixel((5, 3)), RED, tolerance=12)


def test_data_uri_with_line_breaks_and_upper_case(no_fetch: None) -> None:
    text = b64(encode(Image.new("RGB", (6, 4), BLUE), "PNG"))
    wrapped = "\n".join(text[i : i + 20] for i in range(0, len(text), 20))
    img = load_image(f"  DATA:image/PNG;BASE64,{wrapped}\n", POLICY, LIMITS, param=PARAM)
    assert img.size == (6, 4)


def test_bare_base64_works_with_or_without_padding(no_fetch: None) -> None:
    data = encode(Image.new("RGB", (5, 3), RED), "PNG")
    assert load_image(b64(data), POLICY, LIMITS, param=PARAM).size == (5, 3)
    unpadded = b64(data).rstrip("=")
    assert unpadded != b64(data) or len(data) % 3 == 0
    assert load_image(unpadded, POLICY, LIMITS, param=PARAM).size == (5, 3)


def test_url_is_fetched_with_param_and_the_smaller_byte_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    png = encode(Image.new("RGB", (4, 4), BLUE), "PNG")
    calls: list[tuple[str, FetchPolicy, str]] = []

    def fetch(url: str, policy: FetchPolicy, *, param: str = "url") -> bytes:
        calls.append((url, policy, param))
        return png

    monkeypatch.setattr(decode_module, "fetch_image_bytes", fetch)
    policy = FetchPolicy(allowed_hosts=("127.0.0.1",), max_bytes=10_000_000)
    img = load_image(" HTTPS://images.example/cat.png ", policy, DecodeLimits(max_bytes=5000), param=PARAM)
    assert img.size == (4, 4)
    capped = FetchPolicy(allowed_hosts=("127.0.0.1",), max_bytes=5000)
    assert calls == [("HTTPS://images.example/cat.png", capped, PARAM)]


def test_fetch_refusals_propagate_with_param(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real fetcher: both refusals happen before any connection (which would fail the test)."""

    def connect(*args: object, **kwargs: object) -> None:
        raise AssertionError("connection attempted")

    monkeypatch.setattr(socket.socket, "connect", connect)
    with pytest.raises(BadRequest, match="image URL fetching is disabled") as err:
        load_image("https://example.com/cat.png", FetchPolicy(enabled=False), LIMITS, param=PARAM)
    assert err.value.param == PARAM
    with pytest.raises(BadRequest, match="169.254.169.254, a link-local address") as err:
        load_image("http://169.254.169.254/latest/meta-data/", POLICY, LIMITS, param=PARAM)
    assert err.value.param == PARAM


@pytest.mark.parametrize(
    "ref",
    ["file:///etc/passwd", "ftp://example.com/x.png", "gopher://x/", "javascript:alert(1)", "blob:https://a/b"],
)
def test_other_schemes_refused(ref: str, no_fetch: None) -> None:
    with pytest.raises(BadRequest, match="not supported") as err:
        load_image(ref, POLICY, LIMITS, param=PARAM)
    assert err.value.param == PARAM and PARAM in err.value.message


@pytest.mark.parametrize("ref", ["not base64 at all!", "abc$def", "a", "iVBORw0KGgo=AAAA", "ümlaut"])
def test_invalid_base64_refused(ref: str, no_fetch: None) -> None:
    with pytest.raises(BadRequest, match="invalid base64") as err:
        load_image(ref, POLICY, LIMITS, param=PARAM)
    assert err.value.param == PARAM and err.value.status_code == 400


@pytest.mark.parametrize("ref", ["", "   ", "data:image/png;base64", "data:image/png,iVBORw0KGgo="])
def test_empty_or_malformed_references_refused(ref: str, no_fetch: None) -> None:
    with pytest.raises(BadRequest) as err:
        load_image(ref, POLICY, LIMITS, param=PARAM)
    assert err.value.param == PARAM


def test_valid_base64_of_text_is_not_an_image(no_fetch: None) -> None:
    with pytest.raises(BadRequest, match="not a decodable image") as err:
        load_image(b64(b"hello, this is plain text, not a picture"), POLICY, LIMITS, param=PARAM)
    assert err.value.param == PARAM and PARAM in err.value.message


def test_truncated_and_unsupported_images_refused() -> None:
    png = encode(Image.new("RGB", (64, 64), RED), "PNG", compress_level=0)
    with pytest.raises(BadRequest, match="not a decodable image"):
        decode_image_bytes(png[: len(png) // 2], LIMITS, param=PARAM)
    ppm = encode(Image.new("RGB", (4, 4), RED), "PPM")  # Pillow reads it, but it is not an offered format
    with pytest.raises(BadRequest, match="not a decodable image"):
        decode_image_bytes(ppm, LIMITS, param=PARAM)
    with pytest.raises(BadRequest, match="empty"):
        decode_image_bytes(b"", LIMITS, param=PARAM)


# --- limits --------------------------------------------------------------------------------------------


def test_bomb_over_our_limit_refused_from_the_header(loads: list[tuple[int, int]]) -> None:
    """8000x8000 1-bit PNG: a real, valid image of a few KB that would decode to 64 Mpx (over 40 Mpx)."""
    bomb = crafted_png(8000, 8000, bytes((8000 // 8 + 1) * 8000))
    assert len(bomb) < 100_000
    with pytest.raises(BadRequest, match="8000x8000 = 64000000 pixels, over the limit of 40000000 pixels") as err:
        decode_image_bytes(bomb, LIMITS, param=PARAM)
    assert err.value.param == PARAM
    assert loads == []


@pytest.mark.parametrize("side", [10_000, 30_000])  # Pillow's warning (>89 Mpx) and its error (>179 Mpx)
def test_pillow_bomb_checks_refused_even_with_a_high_limit(side: int, loads: list[tuple[int, int]]) -> None:
    with pytest.raises(BadRequest, match="pixels") as err:
        decode_image_bytes(crafted_png(side, side), DecodeLimits(max_pixels=10**12), param=PARAM)
    assert err.value.param == PARAM
    assert loads == []


def test_pixel_limit_boundary() -> None:
    data = encode(Image.new("RGB", (10, 10), RED), "PNG")
    assert decode_image_bytes(data, DecodeLimits(max_pixels=100), param=PARAM).size == (10, 10)
    with pytest.raises(BadRequest, match="10x10 = 100 pixels, over the limit of 99 pixels"):
        decode_image_bytes(data, DecodeLimits(max_pixels=99), param=PARAM)


def test_byte_limit(no_fetch: None) -> None:
    data = encode(Image.new("RGB", (10, 10), RED), "PNG")
    exact = DecodeLimits(max_bytes=len(data))
    assert decode_image_bytes(data, exact, param=PARAM).size == (10, 10)
    assert load_image(b64(data), POLICY, exact, param=PARAM).size == (10, 10)
    small = DecodeLimits(max_bytes=len(data) - 1)
    with pytest.raises(BadRequest, match=f"{len(data)} bytes, over the limit of {len(data) - 1} bytes"):
        decode_image_bytes(data, small, param=PARAM)
    for ref in (b64(data), f"data:image/png;base64,{b64(data)}"):
        with pytest.raises(BadRequest, match="over the limit") as err:
            load_image(ref, POLICY, small, param=PARAM)
        assert err.value.param == PARAM


def test_oversized_base64_refused_before_decoding(monkeypatch: pytest.MonkeyPatch, no_fetch: None) -> None:
    def b64decode(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("decoded a payload already known to be too large")

    monkeypatch.setattr(base64, "b64decode", b64decode)
    with pytest.raises(BadRequest, match="over the limit of 1000 bytes"):
        load_image("A" * 2000, POLICY, DecodeLimits(max_bytes=1000), param=PARAM)
