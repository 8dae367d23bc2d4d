"""Which path serves a decoder checkpoint under ``option.rolling_batch``: the lean engine's own model code when it
implements the checkpoint (``model.support``, ``model.vision`` for a vision-language model), else the checkpoint's
transformers code (``choose_path``). Reads ``config.json`` and the tensor names only: no weight is loaded here.

May import: ``model.support``, ``model.vision`` and the lean load's options."""

from __future__ import annotations

from handler.engine.lean.options import LoadOptions
from handler.engine.model import vision
from handler.engine.model.support import UnsupportedModel, check_lean, tensor_names


def choose_path(options: LoadOptions, config: dict) -> tuple[str, str]:
    """``("lean" | "transformers", why)`` for ``option.rolling_batch``: auto takes the lean path when it implements
    the checkpoint (``support``), else the checkpoint's own transformers code; lean refuses what it cannot run, and
    both refuse an encoder-decoder model."""
    if config.get("is_encoder_decoder"):
        architectures = ", ".join(config.get("architectures") or []) or "no architecture named"
        raise UnsupportedModel(f"model_type {config.get('model_type')!r}: an encoder-decoder model ({architectures}); "
                               "this server generates with decoder-only models (transformers' causal-LM class would "
                               "load its decoder alone, without the encoder)")
    if vision.is_vision_model(config):
        return _choose_vision_path(options, config)
    if options.rolling_batch == "transformers":
        return "transformers", "option.rolling_batch=transformers"
    try:
        check_lean(config, tensor_names(options.model_dir), options.max_model_len)
    except UnsupportedModel as error:
        if options.rolling_batch == "lean":
            raise
        return "transformers", f"{error} (exact, slower)"
    return "lean", "the lean engine implements this checkpoint"


def _choose_vision_path(options: LoadOptions, config: dict) -> tuple[str, str]:
    """A VLM: lean when ``vision`` runs its type and language model (auto, lean); any other VLM transformers knows
    on the transformers path under auto (``option.rolling_batch=transformers`` forces it for any VLM); lean loads and
    refuses there (``vision.text_config``'s reason). Types refused on both paths (``vision.refused_everywhere``)
    raise here."""
    if reason := vision.refused_everywhere(config):
        raise UnsupportedModel(reason)
    if options.rolling_batch == "transformers":
        return "transformers", "option.rolling_batch=transformers (vision-language model, exact, slower)"
    try:
        vision.check_text_model(vision.text_config(config), options.max_model_len)
    except (ValueError, UnsupportedModel) as error:
        if options.rolling_batch == "lean":
            return "lean", "option.rolling_batch=lean"  # loaders.load_lean_model refuses it with the reason
        if not vision.transformers_knows(config):
            return "lean", "transformers does not know this vision-language model"  # refused there too
        return "transformers", f"the lean path cannot run this vision-language model: {error} (exact, slower)"
    return "lean", "the lean engine implements this vision-language model"
