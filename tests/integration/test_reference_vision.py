"""VLMs the lean path cannot run, served on the transformers path (``reference.TransformersRunner`` driven as
``generate`` drives the model): our engine's greedy tokens equal transformers' ``generate`` on the same inputs. For
the families whose processor also takes video (Qwen VL, SmolVLM2) both sides use the processor built without it
(torchvision is missing), so the image inputs are the same; the numbers compared are the model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from handler.engine.lean.options import LoadOptions
from handler.engine.lean.paths import choose_path
from handler.engine.model.family import read_config
from handler.engine.model.support import UnsupportedModel
from handler.engine.model.vision import ImageProcessor
from handler.engine.types import GenerationRequest, StopConditions
from tests.integration.conftest import engine_on_path
from tests.support.vision_fixture import build_tiny_vlm

MAX_NEW = 8
IMAGE_REQUIRED = {"paligemma"}  # families whose processor refuses a prompt without an image


def image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


# the last five: processors loaded without their video processor (``processor.load_processor``)
@pytest.fixture(scope="module", params=["llava_next", "gemma3", "paligemma", "mllama", "qwen2_vl", "qwen2_5_vl",
                                        "qwen3_vl", "qwen3_vl_moe", "smolvlm"])
def vlm_dir(request, tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def engine(vlm_dir):
    engine = engine_on_path(vlm_dir, "auto", "transformers")
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def hf_model(vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32, local_files_only=True).eval()


def generate(model, processor: ImageProcessor, messages: list[dict], images: list[Image.Image],
             zero_pixels: bool = False, with_logprobs: bool = False):
    """transformers' own greedy generate on the processor's inputs: its tokens (and each one's logprob, from the
    raw logits)."""
    text = processor.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor.processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt")
    if zero_pixels:  # one grey, not 0: SmolVLM2 takes an all-zero view for padding and drops it
        inputs["pixel_values"] = torch.full_like(inputs["pixel_values"], 0.25)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                             output_logits=True, return_dict_in_generate=True)
    chosen = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    if not with_logprobs:
        return chosen
    return chosen, [torch.log_softmax(step[0].float(), -1)[token].item() for step, token in zip(out.logits, chosen,
                                                                                                  strict=True)]


def ours(engine, processor: ImageProcessor, messages: list[dict], images: list[Image.Image],
         name: str = "r") -> tuple[list[int], object]:
    prompt = processor.encode(messages, images)
    request = GenerationRequest(name, tuple(prompt.prompt_ids), stop=StopConditions(max_new_tokens=MAX_NEW,
                                                                                    ignore_eos=True),
                                prompt_images=prompt.images)
    return request, engine.submit(request)


def steps(handle) -> tuple[list[int], list[float]]:
    events = [event for event in handle if event.token_id is not None]
    return [event.token_id for event in events], [event.logprob for event in events]


def test_auto_serves_it_on_the_transformers_path_and_lean_refuses(vlm_dir):
    config = read_config(vlm_dir)
    auto = LoadOptions(vlm_dir, "float32", False, "cpu", max_running=2, max_model_len=128, rolling_batch="auto")
    path, reason = choose_path(auto, config)
    assert path == "transformers" and "lean path cannot run" in reason
    lean = LoadOptions(vlm_dir, "float32", False, "cpu", max_running=2, max_model_len=128, rolling_batch="lean")
    assert choose_path(lean, config)[0] == "lean"  # and load_lean_model refuses it, with vision.text_config's reason
    for rolling_batch in ("auto", "lean", "transformers"):
        options = LoadOptions(vlm_dir, "float32", False, "cpu", max_running=2, max_model_len=128,
                              rolling_batch=rolling_batch)
        # PixtralProcessor (Mistral 3; Pixtral-12B is saved as llava with a pixtral tower) imports torchvision
        for pixtral in ({"model_type": "mistral3", "vision_config": {}},
                        {"model_type": "llava", "vision_config": {"model_type": "pixtral"}}):
            with pytest.raises(UnsupportedModel, match="PixtralProcessor, imports torchvision"):
                choose_path(options, pixtral)


def test_llava_stays_lean_under_auto(tmp_path):
    folder = build_tiny_vlm(tmp_path / "llava", "llava")
    options = LoadOptions(folder, "float32", False, "cpu", max_running=2, max_model_len=128, rolling_batch="auto")
    assert choose_path(options, read_config(folder))[0] == "lean"
    forced = LoadOptions(folder, "float32", False, "cpu", max_running=2, max_model_len=128,
                         rolling_batch="transformers")
    assert choose_path(forced, read_config(folder))[0] == "transformers"


def test_greedy_equals_generate_with_images(vlm_dir, engine, hf_model):
    processor = ImageProcessor.load(vlm_dir, keep_inputs=True)  # as the transformers path loads it
    cases = [
        (user({"type": "image"}, {"type": "text", "text": "What is this?"}), [image(40, 24, 1)]),
        (user({"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "and"},
              {"type": "image"}), [image(24, 40, 2), image(32, 32, 3)]),
        (user({"type": "text", "text": "Say something without a picture."}), []),
    ]
    if read_config(vlm_dir)["model_type"] in IMAGE_REQUIRED:  # text alone is refused before it reaches a path
        with pytest.raises(ValueError, match="images"):
            processor.encode(*cases.pop())
    submitted = [ours(engine, processor, messages, images, f"r{i}") for i, (messages, images) in enumerate(cases)]
    got = [steps(handle) for _request, handle in submitted]  # run together: interleaved in the engine's steps
    for (messages, images), (mine, my_logprobs) in zip(cases, got, strict=True):
        expected, logprobs = generate(hf_model, processor, messages, images, with_logprobs=True)
        assert mine == expected, (messages, mine, expected)
        # the numbers too, not only their argmax (a family input lost, e.g. gemma3's token types, moves them)
        assert my_logprobs == pytest.approx(logprobs, abs=1e-3), (messages, my_logprobs, logprobs)
        if images:  # the image matters: without its pixels, transformers answers otherwise
            assert generate(hf_model, processor, messages, images, zero_pixels=True) != expected
