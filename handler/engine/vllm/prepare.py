"""What the vLLM backend needs before vLLM starts, on its own thread: vLLM's engine arguments (``args``), the
environment its processes inherit, the model's vocabulary for our detokenizer, and what the prompt layer renders
with (the tokenizer and chat template, as on the lean engine; for a vision-language model the checkpoint's processor,
since vLLM runs the vision tower itself and takes decoded images)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from handler.config import Settings
from handler.engine.core.request import Vocabulary
from handler.engine.core.scoring import is_cross_encoder, read_activation
from handler.engine.core.tokenizer import eos_token_ids, load_tokenizer
from handler.engine.types import PromptParts
from handler.engine.vllm.args import Placement, engine_environment, engine_kwargs
from handler.engine.vllm.backend import Prepared


def prepare(settings: Settings, max_model_len: int,
            on_parts: Callable[[PromptParts, str, str], str | None]) -> Prepared:
    """The engine arguments and vocabulary; ``on_parts(parts, "vllm", why)`` hands the prompt layer its tokenizer."""
    from vllm.platforms import current_platform

    model_config = json.loads((settings.model_dir / "config.json").read_text())
    device = current_platform.device_type
    num_gpus = 0
    if device == "cuda":
        import torch

        num_gpus = torch.cuda.device_count()
    placement = Placement(device, num_gpus, tuple(sorted(os.sched_getaffinity(0))))
    tokenizer = load_tokenizer(settings.model_dir)
    images = None
    if "vision_config" in model_config:  # vLLM runs the vision tower: the prompt layer hands it decoded images
        from handler.engine.model.vision import ImageProcessor

        images = ImageProcessor.load(settings.model_dir)
    # the prompt layer's reasoning format (detected from the template under auto) gates vLLM's structured outputs
    reasoning_parser = on_parts(PromptParts(tokenizer, images), "vllm",
                                f"option.rolling_batch={settings.rolling_batch}, {device}")
    kwargs = engine_kwargs(settings, placement, max_model_len, model_config, reasoning_parser)
    os.environ.update(engine_environment(settings, placement, dict(os.environ)))  # vLLM's processes inherit it
    vocabulary = Vocabulary(tokenizer.backend_tokenizer, eos_token_ids(settings.model_dir, tokenizer),
                            frozenset(tokenizer.all_special_ids))
    activation = read_activation(model_config).name if is_cross_encoder(model_config) else None  # args checked it
    return Prepared(kwargs, vocabulary, activation)
