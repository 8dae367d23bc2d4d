"""A thinking model's answer split through the real server (``python -m handler serve``: gunicorn, the lean engine,
int8 as shipped), read by the unchanged openai SDK.

Tiny random checkpoints cannot think, so this one is built to write one transcript: a tiny llama whose attention
and MLP outputs are zero (each layer passes the residual through), so the logits depend on the current token only,
and whose embeddings and output rows chain the transcript's tokens: the embedding of token a is a random direction
u_a and the output row of the token that follows a is 5·u_a. Greedy decoding then walks the chain from the prompt's
last token (``\\n`` of Qwen3's generation prompt) to ``<|im_end|>``. The tokenizer is the embedded one with Qwen3's
``<think>`` / ``</think>`` added, the chat template Qwen3's real one (so the server detects ``qwen3`` itself).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests

from tests.e2e.conftest import RunningServer, start_server, stop_server

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "templates" / "Qwen-Qwen3-0.6B.jinja"
TRANSCRIPT = "<think>The user asks about France.</think>Paris!"
QUESTION = [{"role": "user", "content": "Capital of France?"}]


def build_thinking_llama(path: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tests.tiny_checkpoints import SMOLLM2_DIR, build_tiny

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    build_tiny(path, "llama", vocab_size=len(tokenizer))
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(TEMPLATE.read_text())

    chain = [tokenizer.convert_tokens_to_ids("Ċ"), *tokenizer.encode(TRANSCRIPT), tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "a token-only model can follow a chain of distinct tokens only"
    tensors = load_file(path / "model.safetensors")
    for name, value in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(value)
    head = torch.zeros_like(tensors["lm_head.weight"])
    generator = torch.Generator().manual_seed(0)
    for current, following in zip(chain, chain[1:], strict=False):
        direction = torch.randn(head.shape[1], generator=generator)
        direction /= direction.norm()
        tensors["model.embed_tokens.weight"][current] = direction
        head[following] = 5.0 * direction
    tensors["lm_head.weight"] = head
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Settings as shipped, except ``option.model_id``: the built model, not the embedded one."""
    folder = build_thinking_llama(tmp_path_factory.mktemp("thinking") / "model")
    running = start_server(tmp_path_factory.mktemp("thinking-server"), env={"OPTION_MODEL_ID": str(folder)})
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def sdk(thinking_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="unused", max_retries=0)


def test_the_completions_route_returns_the_raw_transcript(thinking_server: RunningServer) -> None:
    """The model writes the transcript (checked raw, unsplit, where no split applies)."""
    body = {"prompt": "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 20,
            "temperature": 0}
    answer = requests.post(f"{thinking_server.url}/v1/completions", json=body, timeout=120).json()
    assert answer["choices"][0]["text"] == TRANSCRIPT and answer["choices"][0]["finish_reason"] == "stop"


def test_the_sdk_reads_reasoning_and_content(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=20, temperature=0)
    message = completion.choices[0].message
    assert message.content == "Paris!"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == \
           "The user asks about France."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens_details.reasoning_tokens == 7  # 6 thinking tokens and </think>


def test_the_sdk_streams_reasoning_deltas_then_content_deltas(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.model_extra["reasoning"] for d in deltas if (d.model_extra or {}).get("reasoning")]
    content = [d.content for d in deltas if d.content]
    assert reasoning == ["The", " user", " asks", " about", " France", "."]  # one delta per token
    assert content == ["Paris", "!"]
    kinds = ["r" if (d.model_extra or {}).get("reasoning") else "c" for d in deltas if d.content or d.model_extra]
    assert kinds == sorted(kinds, key=lambda k: k != "r")  # every reasoning delta before any content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 7
    assert not any("think>" in json.dumps(d.model_dump()) for d in deltas)

