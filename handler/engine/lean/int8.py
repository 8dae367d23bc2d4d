"""int8 at load: a lean model (the served one, or a draft) quantised, read from the form an earlier start wrote
(``model.packed``) or smoothed on the calibration tokens and written for the next start (``quantize``); the
calibration text as the folder's token ids (``calibration_ids``). The arithmetic is ``model.quantize``'s.

May import: ``model`` (the decoder, ``packed``, ``quantize``) and the lean load's options."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from handler.engine.lean.options import LoadOptions
from handler.engine.model import packed
from handler.engine.model.decoder import DecoderModel
from handler.engine.model.quantize import CALIBRATION_TEXT, calibrate, smooth_and_quantize

log = logging.getLogger(__name__)


def quantize(model: DecoderModel, model_dir: Path, calibration: Callable[[], list[int]],
             options: LoadOptions, rebuild: Callable[[], DecoderModel] | None = None) -> DecoderModel:
    """int8, smoothed on the calibration tokens (the model's, and a draft's): read from the
    form an earlier start wrote (``packed``), else computed and written for the next start. Returns the model:
    ``model`` itself, or, when it was built without its Linears' weights and the file could not be read, the
    model ``rebuild`` reads whole, quantised."""
    if not packed.supports(model):
        smooth_and_quantize(model, calibrate(model, calibration()))
        return model
    path = packed.path_for(model_dir)
    if path.is_file():
        try:
            packed.load(model, path)
            log.info("int8: read the quantised model written by an earlier start (%s)", path)
            return model
        except Exception as error:  # a damaged file: compute it again and replace it
            log.warning("int8: %s could not be read (%s); quantising again", path, error)
    if packed.lacks_weights(model):
        model = rebuild()
    smooth_and_quantize(model, calibrate(model, calibration()))
    try:
        packed.save(model, path)
        log.info("int8: quantised model written for later starts (%s)", path)
    except OSError as error:
        log.warning("int8: the quantised model could not be kept for later starts (%s)", error)
    return model


def calibration_ids(model_dir: Path, loader: threading.Thread | None, result: dict) -> list[int]:
    """CALIBRATION_TEXT as token ids, from tokenizer.json when there is one (else from what ``loader`` loads)."""
    fast = model_dir / "tokenizer.json"
    if fast.is_file():
        return Tokenizer.from_file(str(fast)).encode(CALIBRATION_TEXT, add_special_tokens=False).ids
    loader.join()
    if isinstance(result["tokenizer"], BaseException):
        raise result["tokenizer"]
    return result["tokenizer"].encode(CALIBRATION_TEXT, add_special_tokens=False)
