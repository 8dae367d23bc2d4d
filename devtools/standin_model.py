"""A stand-in for the embedded model on a GPU machine (its 517 MB cannot travel there): SmolLM2-135M-Instruct's own
config, tokenizer and chat template, random weights (seeded). Same shapes, so the same kernels and timings."""
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

source, target = Path(sys.argv[1]), Path(sys.argv[2])
config = LlamaConfig.from_pretrained(source)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
model.save_pretrained(target)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    shutil.copy(source / name, target / name)
print("stand-in written:", sorted(p.name for p in target.iterdir()))
