"""Tiny PEFT LoRA adapters for a tiny checkpoint (``tiny_checkpoints.build_tiny``), built locally with peft itself,
and PEFT's own greedy tokens as the reference our engine is compared with.

``lora_B`` starts at zero in PEFT (an untrained adapter changes nothing), so it is drawn at random here: each adapter
then changes the model's answers, and a wrong or missing delta shows.
"""

from __future__ import annotations

from pathlib import Path

import torch


def build_adapter(base_dir: Path, path: Path, targets: list[str], rank: int, alpha: int, seed: int,
                  **config) -> Path:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) for the checkpoint in ``base_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM",
                      **config)
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(path)
    return path


def peft_greedy(base_dir: Path, adapters: dict[str, Path], prompts: dict[str | None, list[int]],
                num_tokens: int) -> dict[str | None, tuple[list[int], torch.Tensor]]:
    """PEFT's greedy tokens (EOS ignored) and first-token log-probabilities for each ``adapter -> prompt`` (None: the
    base model with adapters disabled), one full forward per token: the reference."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    names = list(adapters)
    peft_model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        peft_model.load_adapter(adapters[name], adapter_name=name)
    results = {}
    for adapter, prompt in prompts.items():
        if adapter is None:
            with peft_model.disable_adapter():
                results[adapter] = _greedy(peft_model, prompt, num_tokens)
        else:
            peft_model.set_adapter(adapter)
            results[adapter] = _greedy(peft_model, prompt, num_tokens)
    return results


@torch.no_grad()
def _greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    ids, out, first = list(prompt), [], None
    for _ in range(num_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        if first is None:
            first = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        out.append(token)
        ids.append(token)
    return out, first
