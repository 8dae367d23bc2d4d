"""The quantised model an earlier start wrote (``handler.engine.model.packed``) serves the same numbers as one
quantised at load: every logit bit for bit, prefill and decode; the file is found again only for the same
checkpoint and the same quantising code, in the cache and never in the model folder; a damaged file is computed
again."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from handler.engine.lean import int8
from handler.engine.lean.options import LoadOptions
from handler.engine.model import packed
from handler.engine.model.decoder import DecoderModel
from handler.engine.model.layout import build_layout
from handler.engine.model.quantize import CALIBRATION_TEXT, calibrate, smooth_and_quantize

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_store" / "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_INT8_CACHE", str(tmp_path / "int8-cache"))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The embedded model's files, linked into a folder of the test's own (the cache is written beside them)."""
    target = tmp_path / "model"
    target.mkdir()
    for file in MODEL_DIR.iterdir():
        if file.is_file():
            (target / file.name).symlink_to(file)
    return target


def calibration() -> list[int]:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(CALIBRATION_TEXT).ids


def logits(model: DecoderModel) -> torch.Tensor:
    """A 40-token prefill then three decode steps, every step's last logits."""
    ids = calibration()[:40]
    cache = model.new_cache(1, 128)
    cache.ensure(1, 128)
    groups = model.shape.num_heads // model.shape.num_kv_heads
    out = [model.forward(torch.tensor(ids), torch.arange(len(ids)), build_layout([], [(0, 0, len(ids))], groups,
                                                                                 model.device),
                         cache, torch.tensor([len(ids) - 1]))]
    for position in range(len(ids), len(ids) + 3):
        out.append(model.forward(torch.tensor([int(out[-1].argmax())]), torch.tensor([position]),
                                 build_layout([position], [], groups, model.device), cache, torch.tensor([0])))
    return torch.cat(out)


def fresh(folder: Path, linears: bool = True) -> DecoderModel:
    return DecoderModel(folder, dtype=torch.float32, device=torch.device("cpu"), linears=linears)


def test_the_written_model_gives_every_logit_bit_for_bit(folder: Path) -> None:
    computed = fresh(folder)
    smooth_and_quantize(computed, calibrate(computed, calibration()))
    path = packed.path_for(folder)
    packed.save(computed, path)
    read = fresh(folder, linears=False)  # as a start builds it when the file is there: no float Linear read
    assert packed.lacks_weights(read)
    packed.load(read, path)
    assert not packed.lacks_weights(read)
    assert torch.equal(logits(read), logits(computed))
    for mine, theirs in zip(read.layers, computed.layers, strict=True):
        assert torch.equal(mine.input_norm, theirs.input_norm) and torch.equal(mine.post_norm, theirs.post_norm)
        assert mine.folds.keys() == theirs.folds.keys()


def test_the_file_is_found_only_for_the_same_model_and_code(folder: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    first = packed.path_for(folder)
    assert first.parent == tmp_path / "int8-cache"  # never in the model folder (the user's; read-only on SageMaker)
    assert packed.path_for(folder) == first
    with monkeypatch.context() as patch:  # other quantising or packing code: another file
        patch.setattr(packed, "_SOURCES", (*packed._SOURCES, __file__))
        assert packed.path_for(folder) != first
    assert packed.path_for(folder) == first
    config = folder / "config.json"
    config.unlink()
    config.write_text((MODEL_DIR / "config.json").read_text() + "\n")  # the same model, a rewritten file
    assert packed.path_for(folder) != first


def test_load_writes_once_then_reads(folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    options = LoadOptions(folder, "float32", True, "cpu", 4, 256)
    caplog.set_level(logging.INFO, logger=int8.__name__)
    first = fresh(folder)
    int8.quantize(first, folder, calibration, options)
    assert "written for later starts" in caplog.text
    caplog.clear()
    assert packed.kept_for(folder, json.loads((folder / "config.json").read_text())) is not None
    second = fresh(folder, linears=False)
    second = int8.quantize(second, folder, lambda: pytest.fail("calibrated although the file was there"),
                           options, rebuild=lambda: pytest.fail("rebuilt although the file was there"))
    assert "read the quantised model" in caplog.text
    assert torch.equal(logits(first), logits(second))


def test_a_damaged_file_is_computed_again(folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    options = LoadOptions(folder, "float32", True, "cpu", 4, 256)
    path = packed.path_for(folder)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not safetensors")
    model = int8.quantize(fresh(folder, linears=False), folder, calibration, options,
                          rebuild=lambda: fresh(folder))  # a start built it for the file it found
    assert "could not be read" in caplog.text and not packed.lacks_weights(model)
    reference = fresh(folder)
    smooth_and_quantize(reference, calibrate(reference, calibration()))
    assert torch.equal(logits(model), logits(reference))
    packed.load(fresh(folder), path)  # replaced by a good one


def test_the_cache_keeps_the_most_recently_used_files(folder: Path, tmp_path: Path) -> None:
    model = fresh(folder)
    smooth_and_quantize(model, calibrate(model, calibration()))
    first = packed.path_for(folder)
    paths = [first.with_name(f"{index}-{first.name}") for index in range(6)]  # six folders' or releases' files
    for index, path in enumerate(paths):
        packed.save(model, path)
        os.utime(path, (1000 + index, 1000 + index))  # written in this order
    assert sorted(p.name for p in paths[0].parent.glob("*.safetensors")) == sorted(p.name for p in paths[2:])
