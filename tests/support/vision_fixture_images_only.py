"""Tiny random checkpoints of the VLM families whose processors also take video (``handler.engine.model.processor``:
loaded here without it, as torchvision is missing). Built as ``tests.support.vision_fixture.build_tiny_vlm`` builds the
others: SmolLM2's tokenizer plus the family's special tokens, random weights, the family's real processor class
(``images_only``, which saves what the full class saves, less the video processor).

- ``qwen2_vl`` / ``qwen2_5_vl`` / ``qwen3_vl`` / ``qwen3_vl_moe``: 8-pixel patches merged 2x2, images resized to
  multiples of 16 pixels between 16x16 and 64x64 pixels (``image_grid_thw``); the text model takes M-RoPE (3-D)
  positions; Qwen2.5-VL's tower has windowed attention, Qwen3-VL's deepstack features, the MoE one 4 experts.
- ``smolvlm``: SmolVLM2 (Idefics3-like: up to 2x2 32-pixel tiles of 4 image tokens plus a global view, Llama text
  model).
"""

from __future__ import annotations

from pathlib import Path

from handler.engine.model.processor import images_only
from tests.support.vision_fixture import IDEFICS3_TEMPLATE, IDEFICS3_TOKENS, _save, _spread, _text_config, _tokenizer

# Qwen2-VL's style: "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>text<|im_end|>\n..."
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_PATCH = 8


def build_qwen_vl(path: Path, head_dim: int, model_type: str) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer(QWEN_VL_TOKENS, eos_token="<|im_end|>")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    config = AutoConfig.for_model(model_type, text_config=_qwen_text(tokenizer, head_dim, model_type),
                                  vision_config=_qwen_vision(model_type, 4 * head_dim), tie_word_embeddings=False,
                                  **ids)
    image_processor = Qwen2VLImageProcessorPil(patch_size=_PATCH, merge_size=2, temporal_patch_size=2,
                                               min_pixels=16 * 16, max_pixels=64 * 64, image_mean=[0.5] * 3,
                                               image_std=[0.5] * 3)
    processor = images_only(model_type)(image_processor=image_processor, tokenizer=tokenizer,
                                        chat_template=QWEN_VL_TEMPLATE)
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    model = AutoModelForImageTextToText.from_config(config).eval()
    _spread(model)
    _save(path, model, processor, tokenizer.convert_tokens_to_ids("<|im_end|>"))


def _qwen_text(tokenizer, head_dim: int, model_type: str) -> dict:
    """The language model: Llama-sized as ``_text_config``'s, with M-RoPE sections splitting head_dim / 2 into
    (time, height, width)."""
    text = _text_config(tokenizer, tie=False, head_dim=head_dim).to_dict()
    text.pop("model_type")  # the family's text config class, not Llama's
    half = head_dim // 2
    sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    text["hidden_size"] = 4 * head_dim  # Qwen2-VL's text model takes head_dim from hidden_size / heads
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0, "mrope_section": sections}
    if model_type.startswith("qwen3_vl"):
        text["rope_parameters"]["mrope_interleaved"] = True
    if model_type == "qwen3_vl_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    return text


def _qwen_vision(model_type: str, text_hidden: int) -> dict:
    common = {"depth": 2, "num_heads": 2, "patch_size": _PATCH, "spatial_merge_size": 2, "temporal_patch_size": 2}
    if model_type == "qwen2_vl":
        return {**common, "embed_dim": 32, "hidden_size": text_hidden, "mlp_ratio": 2}
    common.update(hidden_size=32, intermediate_size=64, out_hidden_size=text_hidden)
    if model_type == "qwen2_5_vl":  # windows of 32 pixels (2x2 merged patches); the second block attends fully
        return {**common, "window_size": 4 * _PATCH, "fullatt_block_indexes": [1]}
    return {**common, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}


def build_smolvlm(path: Path, head_dim: int) -> None:
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm import SmolVLMImageProcessorPil

    tokenizer = _tokenizer(IDEFICS3_TOKENS, eos_token="<end_of_utterance>")
    tile = 32  # 4 image tokens a tile: two images of up to 5 views fit the engine tests' 128-token context
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": tile, "patch_size": 8}
    config = SmolVLMConfig(vision_config=vision,
                           text_config=_text_config(tokenizer, tie=False, head_dim=head_dim).to_dict(),
                           scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    image_processor = SmolVLMImageProcessorPil(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile},
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3, do_image_splitting=True)
    image_seq_len = (tile // 8) ** 2 // 2**2  # patches per tile / scale_factor**2
    processor = images_only("smolvlm")(image_processor=image_processor, tokenizer=tokenizer,
                                       image_seq_len=image_seq_len, chat_template=IDEFICS3_TEMPLATE)
    tokenizer.chat_template = IDEFICS3_TEMPLATE
    model = SmolVLMForConditionalGeneration(config).eval()
    _spread(model)
    _save(path, model, processor, tokenizer.convert_tokens_to_ids("<end_of_utterance>"))
