"""Vision inputs for vision-language models (VLMs): images -> embeddings for the image-token positions of a prompt.

A VLM here is split in two. This module keeps the checkpoint's own processor (chat template, image resizing and
tiling, image-token expansion) and its own vision tower + connector, run by transformers' code
(``get_image_features``). The language model is the lean ``DecoderModel``, built from ``text_config`` and
``text_state_dict``, which takes the returned embeddings in place of the image tokens' embeddings. Only the vision
tower and connector are materialised here: the HF model is built with empty (meta) parameters and only the vision
tensors are read from the checkpoint, so no second copy of the language model exists.

Supported ``model_type`` values (``SUPPORTED_VISION_TYPES``), each checked against transformers' full forward by
``tests/integration/test_vision.py`` on a tiny random checkpoint:

- ``idefics3``: Idefics3 and SmolVLM v1 (SmolVLM-256M/500M/2.2B-Instruct are saved as idefics3): SigLIP tower,
  pixel-shuffle connector, Llama text model. With image splitting on, an image is resized so its longest edge is
  the processor's ``size["longest_edge"]`` (small images are scaled up), cut into square tiles plus one global
  view, and each tile costs ``image_seq_len`` image tokens: the count depends on the aspect ratio, not the size.
  The processor outputs ``pixel_attention_mask`` besides ``pixel_values``.
- ``llava``: LLaVA-1.5 style (CLIP tower, MLP projector, Llama/Mistral/Qwen2 text model): one fixed-size view per
  image, a fixed number of image tokens in one run.

The language model must be one of ``TEXT_MODEL_TYPES`` (llama, mistral, qwen2) with plain 1-D positions. The lean
path refuses Qwen2-VL / Qwen2.5-VL / Qwen3-VL (multimodal rotary positions, M-RoPE: 3-D position ids) and every other
VLM (llava_next, gemma3, mllama, mistral3, paligemma, ...): under ``option.rolling_batch=auto`` ``loader.choose_path``
serves those transformers knows on the transformers path instead (``reference.TransformersRunner``: the checkpoint's
own image-text-to-text model, driven as ``generate`` drives it, with ``ImageProcessor`` rendering the prompts;
llava_next, gemma3, paligemma, mllama, qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe and smolvlm (SmolVLM2) proven by
``tests/integration/test_reference_vision.py``). The Qwen VL and SmolVLM2 processors are loaded for images only
(``processor.load_processor``: their video processors need torchvision, which the container does not install).
Pixtral-vision checkpoints (``mistral3``, and ``llava`` with a ``pixtral`` tower) are refused on both paths while
torchvision is missing (``refused_everywhere``): ``PixtralProcessor``'s module imports it even for images.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from handler.engine.model.checkpoint import read_tensors, rename
from handler.engine.model.family import read_config
from handler.engine.model.processor import load_processor
from handler.engine.model.support import UnsupportedModel, unsupported_features
from handler.engine.types import PromptEmbeds, PromptImages

# the lean families a VLM's language model may be: those tested with image embeddings (test_vision.py). Not yet the
# other lean families: granite, for one, would need its embedding_multiplier applied to the image features too
# (model.py folds it into the token embedding table)
TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, slots=True)
class Architecture:
    """Where one VLM family keeps its parts, in the HF base model and in its checkpoints."""

    text_module: str  # the base model's language model: never materialised here
    text_prefixes: tuple[tuple[str, str], ...]  # checkpoint prefix -> Llama prefix, first match wins
    vision_prefixes: tuple[tuple[str, str], ...]  # checkpoint prefix -> path in the base model
    image_inputs: tuple[str, ...]  # processor outputs get_image_features takes besides pixel_values
    low_detail: tuple[tuple[str, object], ...] = ()  # processor kwargs for OpenAI's detail "low" (fewer tokens)


_IDEFICS3 = Architecture(
    text_module="text_model",
    text_prefixes=(("model.text_model.", "model."), ("lm_head.", "lm_head.")),
    vision_prefixes=(("model.vision_model.", "vision_model."), ("model.connector.", "connector.")),
    image_inputs=("pixel_attention_mask",),
    low_detail=(("do_image_splitting", False),),  # one global view of image_seq_len tokens, no tiles
)
# transformers 5 saves model.language_model.* / model.vision_tower.*; older LLaVA checkpoints have no "model." root
_LLAVA = Architecture(
    text_module="language_model",
    text_prefixes=(
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("lm_head.", "lm_head."),
    ),
    vision_prefixes=(
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("multi_modal_projector.", "multi_modal_projector."),
    ),
    image_inputs=("image_sizes",),
)
ARCHITECTURES = {"idefics3": _IDEFICS3, "llava": _LLAVA}
SUPPORTED_VISION_TYPES = tuple(ARCHITECTURES)
# refused by the lean path (text_config): auto serves these on the transformers path instead
_MROPE = "its language model takes multimodal rotary positions (M-RoPE, 3-D position ids), which model.py lacks"
_REFUSED = {
    "qwen2_vl": _MROPE,
    "qwen2_5_vl": _MROPE,
    "qwen3_vl": _MROPE,
    "qwen3_vl_moe": _MROPE,
    "smolvlm": "SmolVLM2 is not checked against the lean path yet (the transformers path serves it)",
}


def refused_everywhere(config: dict) -> str | None:
    """Why no path serves this VLM here, else None: Pixtral vision (Mistral 3, Pixtral-12B saved as llava) while
    torchvision is missing, because ``PixtralProcessor``'s module imports it even for images."""
    import importlib.util

    model_type = config.get("model_type")
    tower = (config.get("vision_config") or {}).get("model_type")
    if (model_type == "mistral3" or tower == "pixtral") and importlib.util.find_spec("torchvision") is None:
        return (f"vision model type {model_type!r} (Pixtral vision) is not supported on any path here: its "
                "processor, PixtralProcessor, imports torchvision, which this container does not install")
    return None


def transformers_knows(config: dict) -> bool:
    """Whether transformers has this VLM's model type (the transformers path can load it)."""
    from transformers import CONFIG_MAPPING

    return config.get("model_type") in CONFIG_MAPPING


@dataclass(frozen=True, slots=True)
class MultimodalPrompt:
    """A rendered chat prompt with its images encoded. ``embeddings[i]`` replaces the token embedding at
    ``prompt_ids[image_positions[i]]``; positions are ascending, in runs (one or more per image) between text."""

    prompt_ids: list[int]
    image_positions: list[int]
    embeddings: torch.Tensor | None  # [len(image_positions), text_hidden], the text dtype (None: not encoded here)
    images: PromptImages | None = None  # the images themselves, when a backend encodes them (``ImageProcessor``)

    @property
    def embeds(self) -> PromptEmbeds | None:
        """The image embeddings as the engine takes them (None without images)."""
        return PromptEmbeds(tuple(self.image_positions), self.embeddings) if self.image_positions else None


def is_vision_model(config: dict) -> bool:
    """Whether a config.json describes a VLM (supported or not: ``text_config`` refuses the others)."""
    model_type = config.get("model_type")
    return "vision_config" in config or model_type in ARCHITECTURES or model_type in _REFUSED


def architecture(config: dict) -> Architecture:
    """The supported architecture a VLM config.json names; ValueError saying why for any other."""
    model_type = config.get("model_type")
    if model_type in _REFUSED:
        raise ValueError(f"vision model type {model_type!r} is not supported: {_REFUSED[model_type]}")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"vision model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_VISION_TYPES)}"
        )
    return ARCHITECTURES[model_type]


def language_config(config: dict) -> dict:
    """A VLM's language-model config as one flat dict, for any VLM transformers knows: transformers' own config
    class fills what the checkpoint leaves to defaults. ``tie_word_embeddings`` is the one the full model obeys
    (top level)."""
    from transformers import CONFIG_MAPPING

    if not transformers_knows(config):
        raise ValueError(f"model type {config.get('model_type')!r} is not one transformers knows")
    full = CONFIG_MAPPING[config["model_type"]].from_dict(config)  # as from_pretrained reads config.json
    text = full.get_text_config(decoder=True).to_dict()
    text["tie_word_embeddings"] = bool(getattr(full, "tie_word_embeddings", False))
    return text


def text_config(config: dict) -> dict:
    """The language model's config for the lean ``DecoderModel``: a supported architecture's, of a supported
    family; ValueError saying why for any other."""
    architecture(config)
    text = language_config(config)
    if text.get("model_type") not in TEXT_MODEL_TYPES:
        raise ValueError(
            f"{config['model_type']} with a {text.get('model_type')!r} language model is not supported; "
            f"the language model must be one of {', '.join(TEXT_MODEL_TYPES)}"
        )
    return text


def check_text_model(text: dict, max_model_len: int) -> None:
    """The language model's config features the lean engine must implement (``support``); its tensors are
    renamed from the VLM's, so only the config is checked."""
    if reasons := unsupported_features(text, max_model_len):
        raise UnsupportedModel(f"language model {text.get('model_type')!r}: the lean engine does not implement "
                               + "; ".join(reasons))


def text_state_dict(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The language model's tensors under Llama names (``model.embed_tokens.weight``, ``model.layers.{i}.*``,
    ``model.norm.weight``, ``lm_head.weight``); the tensors are shared, not copied."""
    prefixes = architecture(config).text_prefixes
    renamed = {}
    for key, tensor in state.items():
        name = rename(key, prefixes)
        if name is not None:
            renamed[name] = tensor
    if "model.embed_tokens.weight" not in renamed:
        raise ValueError(f"no language-model tensors under {[old for old, _ in prefixes]} in the checkpoint")
    if text_config(config)["tie_word_embeddings"] or "lm_head.weight" not in renamed:
        renamed["lm_head.weight"] = renamed["model.embed_tokens.weight"]
    return renamed


class ImageProcessor:
    """A VLM checkpoint's processor alone: chat messages and images in, the prompt's token ids (image tokens
    expanded) out, with the images (``PromptImages``) for a backend that runs the vision tower itself: the decoded
    images for vLLM (which knows more VLM families than ``ARCHITECTURES`` and runs the processor again), or with
    ``keep_inputs`` the processor's outputs for the transformers path (its model takes them as they are).
    ``encode`` keeps no state, so threads may call it at once."""

    def __init__(self, processor, low_detail: dict | None = None, keep_inputs: bool = False) -> None:
        self.processor = processor
        self._low_detail = low_detail or {}
        self._keep_inputs = keep_inputs

    @classmethod
    def load(cls, model_dir: Path, keep_inputs: bool = False) -> ImageProcessor:
        known = ARCHITECTURES.get(read_config(model_dir).get("model_type"))
        return cls(load_processor(model_dir), dict(known.low_detail) if known else None, keep_inputs)

    def encode(self, messages: list[dict], images: list[Image.Image], *, low_detail: bool = False) -> MultimodalPrompt:
        """Render ``messages`` (HF chat format; ``{"type": "image"}`` parts stand for ``images``, in order) with the
        generation prompt and expand the image tokens. ValueError when the image parts, the image tokens (a text
        part may spell one out) and the images do not agree.

        ``low_detail`` (OpenAI's ``detail: "low"``) asks for the architecture's cheapest view: Idefics3 skips
        image splitting (one view instead of up to 37 tiles); LLaVA has only one view anyway."""
        text, options, inputs = self._process(messages, images, low_detail)
        placeholders = tuple(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        given = None
        if images and self._keep_inputs:
            kept = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
            given = PromptImages(placeholders, (), tuple(options.items()), kept)
        elif images:
            given = PromptImages(placeholders, tuple(images), tuple(options.items()))
        return MultimodalPrompt(inputs["input_ids"][0].tolist(), [], None, given)

    def _process(self, messages: list[dict], images: list[Image.Image], low_detail: bool):
        """The rendered template, the processor options used and the processor's outputs."""
        options = self._low_detail if low_detail else {}
        num_parts = sum(_count_image_parts(message.get("content")) for message in messages)
        if num_parts != len(images):
            raise ValueError(f"the messages have {num_parts} image parts but {len(images)} images were given")
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        try:  # the template already holds the special tokens; the processor checks image tokens against images
            inputs = self.processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt",
                                    **options)
        except ValueError as error:  # e.g. a text part spelling out the image token itself
            raise ValueError(f"the prompt does not match its images: {error}") from error
        return text, options, inputs


class VisionEncoder(ImageProcessor):
    """The processor plus the checkpoint's vision tower and connector: the prompt's token ids and its image-token
    embeddings out, for the lean language model. ``encode`` only reads the modules, so threads may call it at once
    (each call's tensors are its own; torch ops release the GIL)."""

    def __init__(
        self,
        processor,
        model: torch.nn.Module,
        image_token_id: int,
        image_inputs: tuple[str, ...],
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        low_detail: dict | None = None,
    ) -> None:
        super().__init__(processor, low_detail)
        self.model = model  # the HF base model, its language model removed
        self._image_token_id = image_token_id
        self.image_inputs = image_inputs
        self.hidden_size = hidden_size
        self.dtype, self.device = dtype, device

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device) -> VisionEncoder:
        """The processor and the vision tower + connector in ``dtype``, which is also the embeddings' dtype. On a
        CPU without bf16 matrix units (no AVX512-BF16/AMX) prefer float32 here whatever the text model's dtype:
        a SmolVLM-256M-sized tower took 40 s per 512-pixel tile in bf16 against 8 s in fp32 on 2 cores."""
        from transformers import AutoConfig

        arch = architecture(read_config(model_dir))
        processor = load_processor(model_dir)
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        image_token_id = config.image_token_id
        if getattr(processor, "image_token_id", image_token_id) != image_token_id:
            raise ValueError(
                f"{model_dir}: the processor's image token id {processor.image_token_id} differs from "
                f"the config's {image_token_id}"
            )
        model = _load_vision_model(model_dir, config, arch, dtype, device)
        hidden_size = config.get_text_config(decoder=True).hidden_size
        return cls(processor, model, image_token_id, arch.image_inputs, hidden_size, dtype, device,
                   dict(arch.low_detail))

    @property
    def image_token_id(self) -> int:
        return self._image_token_id

    def encode(self, messages: list[dict], images: list[Image.Image], *, low_detail: bool = False) -> MultimodalPrompt:
        """As ``ImageProcessor.encode``, with the images encoded into the image tokens' embeddings instead."""
        _text, _options, inputs = self._process(messages, images, low_detail)
        prompt_ids = inputs["input_ids"][0]
        positions = (prompt_ids == self._image_token_id).nonzero().flatten()
        embeddings = self._image_features(inputs) if images else torch.empty(0, self.hidden_size, dtype=self.dtype)
        if len(positions) != embeddings.shape[0]:
            raise ValueError(
                f"the prompt has {len(positions)} image tokens but the images gave {embeddings.shape[0]} feature rows"
            )
        return MultimodalPrompt(prompt_ids.tolist(), positions.tolist(), embeddings)

    def _image_features(self, inputs) -> torch.Tensor:
        """The vision tower + connector on the processor's outputs: ``[num_image_tokens, text_hidden]``."""
        pixel_values = inputs["pixel_values"].to(self.device, self.dtype)
        extra = {name: inputs[name].to(self.device) for name in self.image_inputs if name in inputs}
        with torch.inference_mode():
            features = self.model.get_image_features(pixel_values=pixel_values, **extra).pooler_output
        # pooler_output: one [tokens, hidden] tensor per image (LLaVA) or per prompt (Idefics3), in prompt order
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in features]).to(self.dtype)


def _count_image_parts(content: object) -> int:
    if not isinstance(content, list):
        return 0
    return sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")


def _load_vision_model(
    model_dir: Path, config, arch: Architecture, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    """The HF base model with only its vision tower and connector: parameters built empty (meta), the language
    model dropped before anything of it is allocated, then the vision tensors read from the checkpoint. Buffers are
    built for real (they are computed, e.g. position ids, and not stored in checkpoints)."""
    from accelerate import init_empty_weights
    from transformers import AutoModel

    with init_empty_weights(include_buffers=False):
        model = AutoModel.from_config(config)
    setattr(model, arch.text_module, None)
    model.load_state_dict(read_tensors(model_dir, arch.vision_prefixes, dtype), strict=False, assign=True)
    missing = [name for name, param in model.named_parameters() if param.is_meta]
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}")
    return model.to(device).eval()
