"""The tokenizer class ``AutoTokenizer`` picks for a folder is recorded in the start cache, and a later load that
constructs it from the record (``handler.engine.core.tokenizer``) gives the same tokenizer: class, vocabulary,
special tokens, chat template, the same ids and text; without importing the model family's config module (the ~3 s
of start-up the record saves). A changed folder is decided again; a record that cannot load falls back."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from handler.engine.core import tokenizer as tokenizer_module
from handler.engine.core.tokenizer import load_tokenizer, record_path

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "model_store" / "smollm2-135m-instruct"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est la gare? 🚉"}]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLM_INT8_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def model_folder(tmp_path: Path, model_type: str) -> Path:
    """The embedded model's tokenizer files, with a config naming ``model_type`` (transformers picks the tokenizer
    class by it: llama's is the generic backend, qwen2's a class of its own)."""
    folder = tmp_path / model_type
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        (folder / name).symlink_to(MODEL_DIR / name)
    config = json.loads((MODEL_DIR / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return folder


def behaviour(tokenizer) -> dict:
    return {
        "class": type(tokenizer),
        "backend": tokenizer.backend_tokenizer.to_str(),
        "init_kwargs": {k: v for k, v in tokenizer.init_kwargs.items() if k != "name_or_path"},
        "special": (tokenizer.all_special_ids, tokenizer.all_special_tokens, tokenizer.eos_token_id,
                    tokenizer.bos_token_id, tokenizer.pad_token_id),
        "template": tokenizer.chat_template,
        "ids": tokenizer.encode("Hello  world,\n\tça va? 123"),
        "chat": tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
        "decoded": tokenizer.decode(tokenizer.encode("  spaced   out ✓"), skip_special_tokens=True),
    }


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_recorded_class_loads_the_tokenizer_autotokenizer_loads(tmp_path: Path, model_type: str) -> None:
    from transformers import AutoTokenizer

    folder = model_folder(tmp_path, model_type)
    expected = behaviour(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    assert not record_path(folder).exists()
    first = load_tokenizer(folder)  # asks AutoTokenizer, records its class
    record = json.loads(record_path(folder).read_text())
    assert record == {"module": type(first).__module__, "name": type(first).__name__}
    assert behaviour(first) == expected
    assert behaviour(load_tokenizer(folder)) == expected  # from the record
    if model_type == "qwen2":
        assert expected["class"].__name__ == "Qwen2Tokenizer"  # not the generic class: the record carries it


def test_a_start_with_a_record_does_not_import_the_model_config(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "llama")
    load_tokenizer(folder)
    probe = ("import sys; from pathlib import Path; from handler.engine.core.tokenizer import load_tokenizer; "
             f"t = load_tokenizer(Path({str(folder)!r})); print(type(t).__name__, "
             "'transformers.models.llama.configuration_llama' in sys.modules, 'torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=os.environ, capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == ["TokenizersBackend", "False", "False"]


def test_a_changed_folder_is_decided_again(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "llama")
    load_tokenizer(folder)
    before = record_path(folder)
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "qwen2"}))
    os.utime(config, ns=(before.stat().st_mtime_ns, before.stat().st_mtime_ns + 10**9))
    assert record_path(folder) != before
    assert type(load_tokenizer(folder)).__name__ == "Qwen2Tokenizer"


def test_a_record_that_cannot_load_falls_back_to_autotokenizer(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    folder = model_folder(tmp_path, "llama")
    path = record_path(folder)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"module": "transformers.no_such_module", "name": "Gone"}))
    with caplog.at_level(logging.WARNING, logger=tokenizer_module.__name__):
        tokenizer = load_tokenizer(folder)
    assert type(tokenizer).__name__ == "TokenizersBackend"
    assert "could not load" in caplog.text
    assert json.loads(path.read_text())["name"] == "TokenizersBackend"  # recorded again
