"""VLMs the lean path cannot run (tiny LLaVA-NeXT; tiny Qwen2-VL, whose processor is loaded without its video
processor), served on the transformers path through the real server: a chat request with a base64 image answers what
transformers' own greedy ``generate`` answers."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import requests
import torch
from PIL import Image

from handler.engine.model.processor import load_processor
from tests.e2e.conftest import start_server, stop_server
from tests.support.vision_fixture import SMOLLM2_DIR, build_tiny_vlm

pytestmark = pytest.mark.skipif(not SMOLLM2_DIR.is_dir(), reason="the embedded model is not assembled (make model)")

MAX_TOKENS = 8


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def expected_text(folder, picture: bytes, question: str) -> str:
    from transformers import AutoModelForImageTextToText

    processor = load_processor(folder)  # AutoProcessor's, but for Qwen2-VL without video (no torchvision here)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.open(io.BytesIO(picture)).convert("RGB")],
                       add_special_tokens=False, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("architecture", ["llava_next", "qwen2_vl"])
def test_chat_with_a_base64_image_on_the_transformers_path(tmp_path, architecture: str) -> None:
    folder = build_tiny_vlm(tmp_path / f"tiny-{architecture}", architecture)
    picture, question = png(40, 24, 7), "What is in this picture?"
    expected = expected_text(folder, picture, question)
    server = start_server(tmp_path, {"OPTION_MODEL_ID": str(folder), "OPTION_MAX_MODEL_LEN": "512",
                                     "OPTION_MAX_NUM_BATCHED_TOKENS": "16"})  # a plan of several prefill chunks
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(picture)
                                                       .decode()}},
                   {"type": "text", "text": question}]
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                max_tokens=MAX_TOKENS, temperature=0,
                                                extra_body={"ignore_eos": True})
        card = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        log = server.log()
    finally:
        stop_server(server)
    assert answer.choices[0].message.content == expected
    assert answer.usage.completion_tokens == MAX_TOKENS
    assert "on the transformers path: the lean path cannot run this vision-language model" in log
    assert card["engine_path"] == "transformers"
