"""A VLM checkpoint's processor, for images only: what ``AutoProcessor`` loads, except for the families whose
processor also builds a video processor, which imports torchvision (not installed here), or checks for num2words
(which only spells out a video's frame count in SmolVLM2's video prompt).

For those (``VIDEO_FAMILIES``) the family's own processor class is loaded without its video processor: the image
processor comes from ``AutoImageProcessor`` (the PIL backend where torchvision is missing: ``Qwen2VLImageProcessorPil``,
``SmolVLMImageProcessorPil``), the tokenizer and chat template as ``from_pretrained`` reads them. Everything else the
class does (the chat template, image-token expansion, ``image_grid_thw``) is its own; a prompt with a video is
never built here (the chat schema carries images only). Mistral 3's ``PixtralProcessor`` is not among them: its module
imports torchvision outright, so ``vision.refused_everywhere`` refuses it while torchvision is missing.
"""

from __future__ import annotations

from pathlib import Path

from handler.engine.model.family import read_config

# model_type -> (module under transformers.models, its processor class)
VIDEO_FAMILIES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLProcessor"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLProcessor"),
    "qwen3_vl_moe": ("qwen3_vl", "Qwen3VLProcessor"),
    "smolvlm": ("smolvlm", "SmolVLMProcessor"),
}


def load_processor(model_dir: Path):
    """The checkpoint's processor: ``AutoProcessor``'s, or for a ``VIDEO_FAMILIES`` family its class without
    video."""
    from transformers import AutoProcessor

    model_type = read_config(model_dir).get("model_type")
    if model_type not in VIDEO_FAMILIES:
        return AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    return images_only(model_type).from_pretrained(str(model_dir), local_files_only=True)


def images_only(model_type: str) -> type:
    """``model_type``'s processor class, taking ``image_processor``, ``tokenizer`` and its options, no video
    processor. Named as the family's class, so that what it saves reads as that class's (the tiny test checkpoints)."""
    import importlib

    module_name, class_name = VIDEO_FAMILIES[model_type]
    module = importlib.import_module(f"transformers.models.{module_name}.processing_{module_name}")
    base = getattr(module, class_name)
    processor_class = _smolvlm_images_only(base) if model_type == "smolvlm" else _qwen_images_only(base)
    processor_class.__name__ = processor_class.__qualname__ = class_name
    return processor_class


def _qwen_images_only(base: type) -> type:
    class ImagesOnly(base):
        # ProcessorMixin takes its sub-processors from __init__'s signature: image_processor and tokenizer here.
        # The base's __init__ hands on a third positional (the video processor, None), which it then ignores.
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
            base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImagesOnly


def _smolvlm_images_only(base: type) -> type:
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnly(base):
        # SmolVLMProcessor.__init__'s attributes, without its num2words check (num2words is for video prompts only)
        def __init__(self, image_processor=None, tokenizer=None, image_seq_len: int = 169, chat_template=None,
                     **kwargs) -> None:
            self.fake_image_token = getattr(tokenizer, "fake_image_token", "<fake_token_around_image>")
            self.image_token = getattr(tokenizer, "image_token", "<image>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.end_of_utterance_token = getattr(tokenizer, "end_of_utterance_token", "<end_of_utterance>")
            self.global_image_token = getattr(tokenizer, "global_image_token", "<global-img>")
            self.image_seq_len = image_seq_len
            self.video_token = getattr(tokenizer, "video_token", "<video>")
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

        def apply_chat_template(self, conversation, chat_template=None, **kwargs):
            # SmolVLMProcessor's own adds the video processor's frame sampling options (num_frames, fps), for video
            return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)

    return ImagesOnly
