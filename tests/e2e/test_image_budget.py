"""A request's images under budgets, through the real server and the tiny Idefics3 of ``tests.support.vision_fixture``:
a slow image server on loopback (allow-listed; nothing leaves the machine) shows a request's URLs fetched at once,
the fetch budget ending a request, the worker's fetch cap answering 429; a pixel bomb under every per-image limit
is refused from its headers with a 400 naming the total-pixel limit.

The server runs with ``option.image_fetch_concurrency=2``, ``option.image_fetch_budget=2`` and
``option.image_wait_timeout=0.5``. Order is decided by the slow server holding its answers until the test releases
them, not by timing; the only timing bound is a generous one on the budget.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.conftest import RunningServer, metric, start_tiny_vlm, stop_server
from tests.support.vision_fixture import SMOLLM2_DIR, SlowImageServer, png_bytes

pytestmark = pytest.mark.skipif(not SMOLLM2_DIR.is_dir(), reason="the embedded model is not assembled (make model)")

FETCH_BUDGET_S = 2


@pytest.fixture()
def slow() -> Iterator[SlowImageServer]:
    server = SlowImageServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_tiny_vlm(tmp_path_factory.mktemp("vlm-budget"), {
        "OPTION_IMAGE_FETCH_CONCURRENCY": "2", "OPTION_IMAGE_FETCH_BUDGET": str(FETCH_BUDGET_S),
        "OPTION_IMAGE_WAIT_TIMEOUT": "0.5"})
    yield server
    stop_server(server)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}  # low: one view, 16 tokens


def chat(vlm: RunningServer, *urls: str) -> requests.Response:
    content = [{"type": "text", "text": "Describe."}, *(image_part(url) for url in urls)]
    return requests.post(f"{vlm.url}/v1/chat/completions", timeout=120,
                         json={"messages": [{"role": "user", "content": content}], "max_tokens": 2})


def test_a_requests_slow_images_are_fetched_at_once(vlm: RunningServer, slow: SlowImageServer) -> None:
    response = chat(vlm, *(slow.url(f"sleep/0.8/{i}") for i in range(3)))
    assert response.status_code == 200, response.text
    assert slow.hits == 3
    assert slow.max_active >= 2  # overlapping fetches (2 = option.image_fetch_concurrency), not one after another


def test_the_fetch_budget_ends_the_request_with_a_400_naming_it(vlm: RunningServer, slow: SlowImageServer) -> None:
    before = metric(vlm.url, 'llm_image_fetch_failures_total{reason="fetch_budget"}')
    response = chat(vlm, slow.url("sleep/0.01/0"), slow.url("hold/1"))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[2]" and error["code"] == "fetch_budget"
    assert "option.image_fetch_budget" in error["message"] and f"{FETCH_BUDGET_S} s" in error["message"]
    assert metric(vlm.url, 'llm_image_fetch_failures_total{reason="fetch_budget"}') == before + 1


def test_past_the_workers_fetch_cap_a_request_gets_429_naming_it(vlm: RunningServer, slow: SlowImageServer) -> None:
    before = metric(vlm.url, 'llm_image_rejections_total{reason="fetch_concurrency"}')
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(chat, vlm, slow.url("hold/0"), slow.url("hold/1"))  # takes both fetch slots
        slow.wait_active(2)
        refused = chat(vlm, slow.url("sleep/0/2"))
        ping = requests.get(f"{vlm.url}/ping", timeout=10)
        slow.release.set()
        held = holder.result(timeout=120)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["param"] == "messages[0].content[1]"
    assert "option.image_fetch_concurrency" in error["message"]
    assert ping.status_code == 200  # the held fetches hold no thread /ping needs
    assert held.status_code == 200, held.text
    assert slow.hits == 2  # the refused request opened no connection
    assert metric(vlm.url, 'llm_image_rejections_total{reason="fetch_concurrency"}') == before + 1
    assert chat(vlm, slow.url("sleep/0/3")).status_code == 200  # the slots came back


def test_a_pixel_bomb_is_refused_from_its_headers_naming_the_total_pixel_limit(vlm: RunningServer) -> None:
    """8 PNGs of 6000x6000, 116 KB each: every one under option.image_max_pixels (40 M), 288 M together."""
    bomb = "data:image/png;base64," + base64.b64encode(png_bytes(6000, 6000)).decode()
    before = metric(vlm.url, 'llm_image_rejections_total{reason="total_pixels"}')
    response = chat(vlm, *[bomb] * 8)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[2]"  # 36 M + 36 M: the second image takes the total past 64 M
    assert "option.image_max_total_pixels" in error["message"] and "288000000 pixels" in error["message"]
    assert metric(vlm.url, 'llm_image_rejections_total{reason="total_pixels"}') == before + 1
