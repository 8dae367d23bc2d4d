"""A tiny llama built to think: greedy decoding writes one Qwen3 transcript, ``<think>…</think>`` then the answer.

Tiny random checkpoints cannot think, so this one is built to write one transcript: a tiny llama whose attention
and MLP outputs are zero (each layer passes the residual through), so the logits depend on the current token only,
and whose embeddings and output rows chain the transcript's tokens: the embedding of token a is a random direction
u_a and the output row of the token that follows a is 5·u_a. Greedy decoding then walks the chain from the prompt's
last token (``\\n`` of Qwen3's generation prompt) to ``<|im_end|>``. The tokenizer is the embedded one with Qwen3's
``<think>`` / ``</think>`` added, the chat template Qwen3's real one (so the server detects ``qwen3`` itself).

Used by the lean engine's e2e test (``tests/e2e/test_reasoning_server.py``) and the vLLM one
(``tests/vllm/test_reasoning.py``, which widens the model: vLLM's CPU attention needs a head size of at least 32).
"""

from __future__ import annotations

from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "templates" / "Qwen-Qwen3-0.6B.jinja"
TRANSCRIPT = "<think>The user asks about France.</think>Paris!"
THINKING = "The user asks about France."
ANSWER = "Paris!"
QUESTION = [{"role": "user", "content": "Capital of France?"}]
RAW_PROMPT = "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"  # QUESTION, rendered


def raw_completion(url: str, timeout: float) -> dict:
    """The server's greedy completion of ``RAW_PROMPT`` on /v1/completions (no chat template, no reasoning split)."""
    import requests

    body = {"prompt": RAW_PROMPT, "max_tokens": 20, "temperature": 0}
    return requests.post(f"{url}/v1/completions", json=body, timeout=timeout).json()["choices"][0]


def build_thinking_llama(path: Path, **overrides) -> Path:
    """The chain model in ``path``; ``overrides`` are config fields over ``build_tiny``'s tiny defaults (sizes)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tests.support.tiny_checkpoints import SMOLLM2_DIR, build_tiny

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    build_tiny(path, "llama", vocab_size=len(tokenizer), **overrides)
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(TEMPLATE.read_text())

    chain = [tokenizer.convert_tokens_to_ids("Ċ"), *tokenizer.encode(TRANSCRIPT), tokenizer.eos_token_id]
    return write_chains(path, [chain])


def write_chains(path: Path, chains: list[list[int]]) -> Path:
    """Make the checkpoint in ``path`` a token-only model that walks each chain: attention and MLP outputs zeroed,
    the embedding of each token a random unit direction and the output row of the token after it that direction
    times 5 (summed where chains share their last token, EOS). A token may have one successor only: no token but
    the last of each chain may appear twice among them."""
    import torch
    from safetensors.torch import load_file, save_file

    walked = [token for chain in chains for token in chain[:-1]]
    assert len(set(walked)) == len(walked), "a token-only model can follow a chain of distinct tokens only"
    tensors = load_file(path / "model.safetensors")
    for name, value in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(value)
    head = torch.zeros_like(tensors["lm_head.weight"])
    generator = torch.Generator().manual_seed(0)
    for chain in chains:
        for current, following in zip(chain, chain[1:], strict=False):
            direction = torch.randn(head.shape[1], generator=generator)
            direction /= direction.norm()
            tensors["model.embed_tokens.weight"][current] = direction
            head[following] += 5.0 * direction
    tensors["lm_head.weight"] = head
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path
