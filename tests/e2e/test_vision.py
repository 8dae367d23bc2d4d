"""Images through the real server into a real (tiny, random) vision-language model: Idefics3, SmolVLM's
architecture, built by ``tests.support.vision_fixture`` and served with ``option.model_id``.

Images arrive as data: URIs, bare base64 (LMI), Azure's ``image`` part and http URLs served by a loopback server
in this test (allow-listed with ``option.image_fetch_allowed_hosts``). A second loopback listener, not allow-listed,
proves a refused URL never gets a connection. No traffic leaves the machine.
"""

from __future__ import annotations

import base64
import socket
from collections.abc import Iterator

import openai
import pytest
import requests

from tests.e2e.conftest import RunningServer, start_tiny_vlm, stop_server
from tests.support.vision_fixture import SMOLLM2_DIR, ImageServer, png_bytes

pytestmark = pytest.mark.skipif(not SMOLLM2_DIR.is_dir(), reason="the embedded model is not assembled (make model)")


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def can_bind(host: str) -> bool:
    try:
        with socket.socket() as sock:
            sock.bind((host, 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def images() -> Iterator[ImageServer]:
    server = ImageServer([png_bytes(64, 64, (20, 160, 20))])
    yield server
    server.close()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_tiny_vlm(tmp_path_factory.mktemp("vlm"))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(vlm: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vlm.url}/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, *parts: dict, **fields):
    content = [{"type": "text", "text": "What is in this picture?"}, *parts]
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=4, **fields)


def image_part(url: str, detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def post(vlm: RunningServer, *parts: dict) -> requests.Response:
    content = [{"type": "text", "text": "Describe."}, *parts]
    return requests.post(f"{vlm.url}/v1/chat/completions", timeout=120,
                         json={"messages": [{"role": "user", "content": content}], "max_tokens": 2})


def test_base64_image_reaches_the_processor(client: openai.OpenAI) -> None:
    """The prompt grows by the processor's image tokens: 17 tiles of 16 for a square image (fixture's tiling)."""
    text_only = client.chat.completions.create(model="tiny", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}]}])
    with_image = ask(client, image_part(data_uri(png_bytes(64, 64))))
    assert with_image.choices[0].finish_reason in ("stop", "length")
    assert with_image.usage.prompt_tokens - text_only.usage.prompt_tokens >= 17 * 16


def test_image_tokens_follow_the_image_shape(client: openai.OpenAI) -> None:
    square = ask(client, image_part(data_uri(png_bytes(64, 64)))).usage.prompt_tokens
    wide = ask(client, image_part(data_uri(png_bytes(800, 200)))).usage.prompt_tokens
    assert square - wide >= (17 - 5) * 16  # 4x4 tiles + global view against 1x4 + global view (+ tile markers)


def test_url_image_is_fetched_from_the_allow_listed_loopback_server(client: openai.OpenAI,
                                                                   images: ImageServer) -> None:
    before = images.hits
    reply = ask(client, image_part(images.url()))
    assert reply.choices[0].message.content is not None
    assert images.hits == before + 1


def test_bare_base64_and_the_azure_image_part(vlm: RunningServer) -> None:
    raw = base64.b64encode(png_bytes(64, 64)).decode()
    for part in (image_part(raw), {"type": "image", "content": raw}):
        response = post(vlm, part)
        assert response.status_code == 200, response.text


def test_two_images_count_twice(client: openai.OpenAI) -> None:
    one = ask(client, image_part(data_uri(png_bytes(64, 64)))).usage.prompt_tokens
    two = ask(client, image_part(data_uri(png_bytes(64, 64))), image_part(data_uri(png_bytes(64, 64))))
    assert two.usage.prompt_tokens - one >= 17 * 16


@pytest.mark.parametrize(("part", "words"), [
    (image_part("data:image/png;base64,@@not-base64@@"), "base64"),
    (image_part(data_uri(b"these bytes are not an image")), "image"),
    (image_part("file:///etc/passwd"), "file"),
    (image_part("http://169.254.169.254/latest/meta-data/"), "169.254.169.254"),
    (image_part("http://2852039166/"), "link-local"),
])
def test_bad_images_are_400s_naming_message_and_part(vlm: RunningServer, part: dict, words: str) -> None:
    response = post(vlm, part)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]"
    assert words in error["message"]


@pytest.mark.skipif(not can_bind("127.0.0.2"), reason="no 127.0.0.2 loopback address here")
def test_a_loopback_host_not_allow_listed_is_refused_before_connecting(vlm: RunningServer) -> None:
    trap = ImageServer([png_bytes(8, 8)], host="127.0.0.2")
    try:
        response = post(vlm, image_part(trap.url()))
    finally:
        trap.close()
    assert response.status_code == 400
    assert "127.0.0.2" in response.json()["error"]["message"] and "loopback" in response.json()["error"]["message"]
    assert trap.hits == 0
    metrics = requests.get(f"{vlm.url}/metrics", timeout=10).text
    assert 'llm_image_fetch_failures_total{reason="blocked_address"}' in metrics


def test_streaming_with_an_image(client: openai.OpenAI) -> None:
    chunks = list(ask(client, image_part(data_uri(png_bytes(32, 32))), stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_text_model_refuses_images(url: str) -> None:
    response = requests.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, image_part(data_uri(png_bytes(8, 8)))]}]})
    assert response.status_code == 400
    assert "not a vision model" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "messages[0].content[1]"


def test_low_detail_takes_one_view_instead_of_tiles(client: openai.OpenAI) -> None:
    image = data_uri(png_bytes(64, 64))
    auto = ask(client, image_part(image)).usage.prompt_tokens
    low = ask(client, image_part(image, detail="low")).usage.prompt_tokens
    assert auto - low >= 16 * 16  # 16 tiles of 16 image tokens fewer: only the global view is left
