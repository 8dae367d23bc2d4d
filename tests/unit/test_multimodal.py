"""The vision prompt path without a model: settings -> fetch policy, image limits, parts -> encoder inputs."""

from __future__ import annotations

import base64
import io
import socket

import pytest
import torch
from PIL import Image

from handler.config import Settings
from handler.engine.model.vision import MultimodalPrompt
from handler.errors import BadRequest
from handler.prompt.renderer import ImageRef
from handler.prompt.vision import VisionRenderer, image_loader


def png_uri(width: int = 4, height: int = 4) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class FakeEncoder:
    """Records what the renderer hands the vision encoder; two image tokens per image."""

    processor = type("Processor", (), {"chat_template": "{{ messages }}"})()

    def __init__(self) -> None:
        self.calls: list[tuple[list[dict], list, bool]] = []

    def encode(self, messages, images, *, low_detail=False):
        self.calls.append((messages, list(images), low_detail))  # the loader drops its images after the encode
        ids = [5, 6] + [9, 9] * len(images) + [7]
        positions = [i for i, t in enumerate(ids) if t == 9]
        return MultimodalPrompt(ids, positions, torch.zeros(len(positions), 4))


class FakeTokenizer:
    chat_template = None
    all_special_ids: list[int] = []

    def convert_tokens_to_ids(self, text: str) -> None:
        return None


def load_one(loader, ref: ImageRef):
    """One image through the worker's loader (the budgets and caps of a whole request apply)."""
    with loader.load([ref]) as images:
        return images[0]


def renderer(settings: Settings | None = None) -> tuple[VisionRenderer, FakeEncoder]:
    encoder = FakeEncoder()
    settings = settings or Settings()
    return VisionRenderer(FakeTokenizer(), "hermes", encoder, image_loader(settings),
                          settings.max_images_per_request), encoder


def test_images_reach_the_encoder_in_order_with_their_embeddings() -> None:
    vision, encoder = renderer()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}, {"type": "image"}]}]
    prompt = vision.render_prompt(messages, images=[ImageRef(png_uri(4, 4), "m[0].c[0]"),
                                                    ImageRef(png_uri(8, 2), "m[0].c[2]")])
    _messages, images, low = encoder.calls[0]
    assert [im.size for im in images] == [(4, 4), (8, 2)] and not low
    assert prompt.embeds.positions == (2, 3, 4, 5) and prompt.embeds.values.shape == (4, 4)


def test_plain_string_content_becomes_a_text_part() -> None:
    vision, encoder = renderer()
    vision.render_prompt([{"role": "user", "content": "hello"}])
    assert encoder.calls[0][0] == [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]


@pytest.mark.parametrize(("details", "low"), [(["low", "low"], True), (["low", "high"], False), (["auto"], False)])
def test_low_detail_applies_when_every_image_asks(details: list[str], low: bool) -> None:
    vision, encoder = renderer()
    refs = [ImageRef(png_uri(), f"p{i}", detail) for i, detail in enumerate(details)]
    vision.render_prompt([{"role": "user", "content": [{"type": "image"}] * len(refs)}], images=refs)
    assert encoder.calls[0][2] is low


def test_too_many_images_names_the_first_one_over() -> None:
    vision, _ = renderer(Settings(max_images_per_request=2))
    refs = [ImageRef(png_uri(), f"messages[0].content[{i}]") for i in range(3)]
    with pytest.raises(BadRequest) as error:
        vision.render_prompt([{"role": "user", "content": [{"type": "image"}] * 3}], images=refs)
    assert error.value.param == "messages[0].content[2]"


def refuse_connections(monkeypatch: pytest.MonkeyPatch) -> list:
    attempts: list = []

    def connect(*args, **kwargs):
        attempts.append(args)
        raise AssertionError("no connection may be opened")

    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: connect(address))
    return attempts


def test_fetching_disabled_refuses_urls_but_not_data(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = refuse_connections(monkeypatch)
    load = image_loader(Settings(image_fetch_enabled=False))
    with pytest.raises(BadRequest) as error:
        load_one(load, ImageRef("http://127.0.0.1:9/x.png", "messages[0].content[1]"))
    assert "disabled" in error.value.message and error.value.code == "fetch_disabled"
    assert load_one(load, ImageRef(png_uri(), "p")).size == (4, 4)
    assert attempts == []


def test_allowed_hosts_come_from_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the allow-list a loopback URL is refused before any connection; with it the fetch is attempted."""
    attempts = refuse_connections(monkeypatch)
    with pytest.raises(BadRequest) as error:
        load_one(image_loader(Settings()), ImageRef("http://127.0.0.1:9/x.png", "p"))
    assert error.value.code == "blocked_address" and attempts == []
    with pytest.raises((AssertionError, BadRequest)):
        allowed = image_loader(Settings(image_fetch_allowed_hosts="127.0.0.1"))
        load_one(allowed, ImageRef("http://127.0.0.1:9/x.png", "p"))
    assert attempts
