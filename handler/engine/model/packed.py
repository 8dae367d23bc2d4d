"""The int8 model as load computes it, written once and read back at later starts: calibration and quantisation run
once per model folder, not at every start, so a start (a scale-out's new instance) takes seconds less.

What is kept: each layer's smoothed norms, every int8 Linear's weights in the kernel's packed layout
(``linear.pack``), scales and bias, the folds adapters follow (``lora.fold``), and the int8 head: everything
``quantize.smooth_and_quantize`` changes. The rest of the model (embeddings, rotary tables, the layer skeleton) is
built from the checkpoint as before. The file is safetensors, memory-mapped when read.

Where: in the start cache (``handler.start_cache``), named by the folder and the source of the code that computes
and reads it (a change to the quantising or packing code names another file). Written to a temporary name and
renamed, so a start killed mid-write leaves no partial file.

Dense decoders only: an MoE layer's experts and router are quantised at every start (``supports``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from handler import start_cache
from handler.engine.model import decoder, family, linear, quantize
from handler.engine.model.family_config import moe_layers
from handler.engine.model.linear import DenseLinear, Int8DynamicLinear
from handler.engine.model.moe import GatedMLP

log = logging.getLogger(__name__)

FORMAT = "3"  # 3: the weights in the kernel's packed layout, no sums
KEEP = 4  # files the cache keeps (most recently used first)
SITES = ("qkv", "out", "mlp.gate_up", "mlp.down")
NORMS = ("input_norm", "post_norm")
_SOURCES = (quantize.__file__, linear.__file__, family.__file__, decoder.__file__, __file__)


def supports(model: decoder.DecoderModel) -> bool:
    """Whether the model's int8 form can be kept: a dense decoder (an MoE's experts are quantised at each start)."""
    return all(isinstance(layer.mlp, GatedMLP) for layer in model.layers)


def kept_for(model_dir: Path, config: dict) -> Path | None:
    """The int8 form kept for this folder, when there is one and the model is dense: a start then builds the model
    without reading its Linears' float weights (``decoder.DecoderModel(linears=False)``), which ``load``
    replaces."""
    if any(moe_layers(config)):
        return None
    path = path_for(model_dir)
    return path if path.is_file() else None


def lacks_weights(model: decoder.DecoderModel) -> bool:
    """Whether a Linear of ``model`` is still one built without its weight (``kept_for``)."""
    linears = [model.lm_head, *(_site(layer, site) for layer in model.layers for site in SITES)]
    return any(isinstance(layer, DenseLinear) and layer.weight is None for layer in linears)


def path_for(model_dir: Path) -> Path:
    """Where the int8 form of this folder is kept (the same on every CPU: the kernel computes the same integers on
    each, so an image prepared on one CPU serves on another)."""
    name = start_cache.name_for(model_dir, FORMAT, _SOURCES)
    return start_cache.home() / f"{name}.safetensors"


def save(model: decoder.DecoderModel, path: Path) -> None:
    """Write the quantised parts of ``model`` (after ``smooth_and_quantize``) to ``path``."""
    tensors: dict[str, torch.Tensor] = {}

    def put(name: str, value: torch.Tensor | float | None) -> None:
        if isinstance(value, torch.Tensor):
            tensors[name] = value.detach().contiguous()
        elif value is not None:
            tensors[name + ".float"] = torch.tensor(float(value), dtype=torch.float64)

    def put_linear(name: str, layer: Int8DynamicLinear) -> None:
        put(f"{name}.packed", layer.packed)
        put(f"{name}.scales", layer.scales)
        put(f"{name}.bias", layer.bias)
        put(f"{name}.in_features", float(layer.in_features))

    for index, layer in enumerate(model.layers):
        for norm in NORMS:
            put(f"{index}.{norm}", getattr(layer, norm))
        for site in SITES:
            put_linear(f"{index}.{site}", _site(layer, site))
        for site, (inputs, outputs) in layer.folds.items():
            put(f"{index}.folds.{site}.input", inputs)
            put(f"{index}.folds.{site}.output", outputs)
    put_linear("lm_head", model.lm_head)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=".partial-")
    os.close(handle)
    try:
        save_file(tensors, partial, metadata={"format": FORMAT})
        os.chmod(partial, 0o644)  # (mkstemp's file is the writer's alone; the server may run as another user)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    start_cache.prune(path.parent, "*.safetensors", KEEP)


def load(model: decoder.DecoderModel, path: Path) -> None:
    """Give ``model`` (built from its checkpoint, not yet quantised) the int8 form written by ``save``."""
    start_cache.touch(path)
    with safe_open(str(path), framework="pt") as file:  # every tensor read before the model changes: a damaged
        tensors = {name: file.get_tensor(name) for name in file.keys()}  # file leaves it as it was

    def get(name: str) -> torch.Tensor | float | None:
        if name in tensors:
            return tensors[name]
        if name + ".float" in tensors:
            return float(tensors[name + ".float"])
        return None

    def get_linear(name: str) -> Int8DynamicLinear:
        return Int8DynamicLinear.from_packed(tensors[f"{name}.packed"], int(get(f"{name}.in_features")),
                                             tensors[f"{name}.scales"], get(f"{name}.bias"))

    linears = {f"{index}.{site}": get_linear(f"{index}.{site}") for index in range(len(model.layers)) for site in SITES}
    for index, layer in enumerate(model.layers):
        for norm in NORMS:
            setattr(layer, norm, get(f"{index}.{norm}"))
        layer.qkv = linears[f"{index}.qkv"]
        layer.out = linears[f"{index}.out"]
        layer.mlp = GatedMLP(linears[f"{index}.mlp.gate_up"], linears[f"{index}.mlp.down"], layer.mlp.activation)
        sites = {name.split(".")[2] for name in tensors if name.startswith(f"{index}.folds.")}
        layer.folds = {site: (get(f"{index}.folds.{site}.input"), get(f"{index}.folds.{site}.output"))
                       for site in sites}
    model.lm_head = get_linear("lm_head")


def _site(layer: family.Layer, site: str) -> Int8DynamicLinear:
    owner, _, name = site.rpartition(".")
    return getattr(layer.mlp if owner == "mlp" else layer, name)


def prepare(model_dir: Path) -> Path:
    """Write the int8 form the default settings read (``make model``, the image build): the embedded model then
    starts without calibrating."""
    from tokenizers import Tokenizer

    path = path_for(model_dir)
    if not path.is_file():
        model = decoder.DecoderModel(model_dir, dtype=torch.float32, device=torch.device("cpu"))
        ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(quantize.CALIBRATION_TEXT,
                                                                            add_special_tokens=False).ids
        quantize.smooth_and_quantize(model, quantize.calibrate(model, ids))
        save(model, path)
    return path
