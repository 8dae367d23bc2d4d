"""Vision inputs: tiny random VLMs of real architectures, encoded by VisionEncoder and run by the lean text model,
checked against transformers' own full forward."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from handler.engine.model.decoder import DecoderModel
from handler.engine.model.family import load_state_dict, read_config
from handler.engine.model.layout import build_layout
from handler.engine.model.vision import (
    SUPPORTED_VISION_TYPES,
    ImageProcessor,
    MultimodalPrompt,
    VisionEncoder,
    is_vision_model,
    text_config,
    text_state_dict,
)
from tests.support.vision_fixture import build_tiny_vlm

CPU = torch.device("cpu")


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A gradient with noise: deterministic, and not constant (a constant tile could pass for padding)."""
    rng = np.random.default_rng(seed)
    ramp = np.add.outer(np.arange(height), np.arange(width))[..., None] * np.array([1, 2, 3])
    pixels = (ramp + rng.integers(0, 64, (height, width, 3))) % 256
    return Image.fromarray(pixels.astype(np.uint8))


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


IMAGE = {"type": "image"}
QUESTION = {"type": "text", "text": "What is in this picture?"}


@pytest.fixture(scope="module", params=["idefics3", "llava"])
def vlm_dir(request, tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def encoder(vlm_dir) -> VisionEncoder:
    return VisionEncoder.load(vlm_dir, torch.float32, CPU)


def lean_model(vlm_dir: Path) -> DecoderModel:
    config = read_config(vlm_dir)
    return DecoderModel(
        vlm_dir,
        dtype=torch.float32,
        device=CPU,
        config=text_config(config),
        state=text_state_dict(load_state_dict(vlm_dir), config),
    )


def prefill(
    model: DecoderModel, prompt: MultimodalPrompt, split: int | None = None, with_images: bool = True
) -> torch.Tensor:
    """Run a prompt through one slot in one chunk or two (split before position ``split``), injecting the image
    embeddings of each chunk as the runner would; logits at every position of the last chunk."""
    ids = prompt.prompt_ids
    bounds = [0, len(ids)] if split is None else [0, split, len(ids)]
    cache = model.new_cache(1, len(ids))
    cache.ensure(1, len(ids))
    groups = model.shape.num_heads // model.shape.num_kv_heads
    for start, end in zip(bounds, bounds[1:], strict=False):
        layout = build_layout([], [(0, start, end - start)], groups, CPU)
        offsets, values = prompt.embeds.in_chunk(start, end - start)
        embeds = (torch.tensor(offsets, dtype=torch.long), values) if with_images else None
        logits = model.forward(
            torch.tensor(ids[start:end]),
            torch.arange(start, end),
            layout,
            cache,
            torch.arange(end - start),
            embeds=embeds,
        )
    return logits


def test_detects_and_refuses_by_model_type():
    assert is_vision_model({"model_type": "idefics3", "vision_config": {}})
    assert is_vision_model({"model_type": "qwen2_vl"})
    assert not is_vision_model({"model_type": "llama"})
    assert set(SUPPORTED_VISION_TYPES) == {"idefics3", "llava"}
    with pytest.raises(ValueError, match="M-RoPE"):
        text_config({"model_type": "qwen2_vl", "vision_config": {}})
    with pytest.raises(ValueError, match="not supported"):
        text_config({"model_type": "mllama", "vision_config": {}})


def test_text_config_is_flat_and_runnable(vlm_dir):
    config = text_config(read_config(vlm_dir))
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (64, 2, 2)
    assert config["tie_word_embeddings"] == (read_config(vlm_dir)["model_type"] == "llava")  # as built
    state = text_state_dict(load_state_dict(vlm_dir), read_config(vlm_dir))
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= state.keys()
    assert not [key for key in state if "vision" in key or "connector" in key or "projector" in key]


# (width, height) -> image tokens. idefics3: resized to a longest edge of 256, cut into 64-pixel tiles + 1 global
# view, 16 tokens each, so the count follows the aspect ratio; llava: always one 32-pixel view of 16 tokens.
IMAGE_TOKENS = {
    "idefics3": {(64, 64): (4 * 4 + 1) * 16, (800, 600): (4 * 3 + 1) * 16, (800, 200): (4 * 1 + 1) * 16},
    "llava": {(64, 64): 16, (800, 600): 16, (800, 200): 16},
}


def test_image_token_count(vlm_dir, encoder):
    expected = IMAGE_TOKENS[read_config(vlm_dir)["model_type"]]
    text_only = encoder.encode(user(QUESTION), [])
    assert text_only.image_positions == [] and text_only.embeddings.shape == (0, 64)
    for (width, height), count in expected.items():
        prompt = encoder.encode(user(IMAGE, QUESTION), [image(width, height)])
        assert len(prompt.image_positions) == count
        assert prompt.embeddings.shape == (count, 64)
        assert all(prompt.prompt_ids[p] == encoder.image_token_id for p in prompt.image_positions)
        assert len(prompt.prompt_ids) > len(text_only.prompt_ids) + count


def test_encoder_holds_only_the_vision_weights(vlm_dir, encoder):
    state = load_state_dict(vlm_dir)
    text = text_state_dict(state, read_config(vlm_dir))
    text_ids = {id(t) for t in text.values()}
    vision_numel = sum(t.numel() for t in state.values() if id(t) not in text_ids)
    assert sum(p.numel() for p in encoder.model.parameters()) == vision_numel


def test_matches_transformers(vlm_dir, encoder):
    from transformers import AutoModelForImageTextToText

    messages = user(IMAGE, QUESTION, IMAGE, {"type": "text", "text": "And this one?"})
    images = [image(800, 600, seed=1), image(200, 300, seed=2)]
    prompt = encoder.encode(messages, images)
    text = encoder.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = encoder.processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == prompt.prompt_ids
    reference = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = reference(**inputs).logits[0]  # [prompt, vocab]

    model = lean_model(vlm_dir)
    ours = prefill(model, prompt)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    # Chunked prefill with the split inside the first image's tokens gives the same last chunk
    split = prompt.image_positions[len(prompt.image_positions) // 4]
    assert torch.allclose(prefill(model, prompt, split), theirs[split:], atol=1e-4)
    # and the image embeddings matter: without them the logits differ
    assert (prefill(model, prompt, with_images=False) - theirs).abs().max() > 1e-3


def test_concurrent_encodes_match_sequential(encoder):
    jobs = [
        (user(IMAGE, QUESTION), [image(800, 600, seed=3)]),
        (user(QUESTION, IMAGE, IMAGE), [image(300, 500, seed=4), image(64, 64, seed=5)]),
    ]
    expected = [encoder.encode(messages, images) for messages, images in jobs]
    barrier = threading.Barrier(len(jobs))
    results: dict[int, list[MultimodalPrompt]] = {}

    def work(index: int) -> None:
        barrier.wait()
        results[index] = [encoder.encode(*jobs[index]) for _ in range(3)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, prompts in results.items():
        for prompt in prompts:
            assert prompt.prompt_ids == expected[index].prompt_ids
            assert prompt.image_positions == expected[index].image_positions
            assert torch.equal(prompt.embeddings, expected[index].embeddings)
    assert len(results) == len(jobs)


@pytest.mark.parametrize(
    "messages, num_images",
    [
        (user(IMAGE, QUESTION), 0),
        (user(QUESTION), 1),
        (user(IMAGE, {"type": "text", "text": "and <image> twice"}), 1),  # a text part spelling the image token
    ],
)
def test_prompt_and_images_must_agree(encoder, messages, num_images):
    with pytest.raises(ValueError):
        encoder.encode(messages, [image(64, 64)] * num_images)


@pytest.mark.parametrize("low_detail", [False, True])
def test_the_processor_alone_expands_as_the_encoder_and_hands_on_the_images(vlm_dir: Path, encoder: VisionEncoder,
                                                                           low_detail: bool) -> None:
    """What the vLLM backend gets: the prompt_ids the lean path runs (image tokens expanded), the template's
    prompt with one image token per image for vLLM's processor to expand, and the decoded images themselves."""
    pictures = [image(96, 64, seed=1), image(40, 40, seed=2)]
    messages = user(QUESTION, IMAGE, IMAGE)
    processor = ImageProcessor.load(vlm_dir)
    alone = processor.encode(messages, pictures, low_detail=low_detail)
    encoded = encoder.encode(messages, pictures, low_detail=low_detail)
    assert alone.prompt_ids == encoded.prompt_ids
    assert alone.embeds is None
    given = alone.images
    assert given.images == tuple(pictures)
    assert given.placeholder_ids.count(encoder.image_token_id) == 2
    assert len(given.placeholder_ids) + 2 * 15 <= len(alone.prompt_ids)  # each image: 16 tokens at least
    splitting = read_config(vlm_dir)["model_type"] == "idefics3" and low_detail
    assert dict(given.processor_kwargs) == ({"do_image_splitting": False} if splitting else {})
    assert processor.encode(user(QUESTION), []).images is None
