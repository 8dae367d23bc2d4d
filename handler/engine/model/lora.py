"""LoRA adapters on the lean model: a PEFT folder read and checked against the model, its deltas folded into the
transforms the model's Linear layers carry since load, and applied to a step's rows adapter by adapter.

Why this shape: one base model serves every adapter. Each targeted Linear computes its base output for all rows
once (int8 or dense), then adds ``(x @ A) @ B * scale`` to the rows of each adapter group, so a step mixes
adapters and the base model and never copies a model per adapter (punica / S-LoRA's idea, without their kernels).
Each row's delta is two bag sums of ``embedding_bag`` over its own adapter's tables, all adapters of a site in one
call, so a row's output does not depend on the rows beside it (``lora_delta``'s doc says why).

What the model folded into its weights at load, an adapter must follow: the attention scale in the query rows,
granite's residual multiplier in ``out`` and ``down``, and int8's SmoothQuant factors (each Linear's input divided
per channel, v and up divided per output channel). ``Layer.folds`` records them per site as (input, output)
factors, and ``fold_delta`` puts them into A's rows and B's columns, so the delta is the adapter's own.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from handler.engine.model.linear import DenseLinear, Int8DynamicLinear
from handler.engine.model.lora_delta import AdapterBatch, bag_delta
from handler.errors import BadRequest

# PEFT's module names -> (our fused site, which part of it, in order; None: the whole site, a projection the
# checkpoint itself fuses: phi3's qkv_proj is q, k, v rows and its gate_up_proj gate then up rows, as our sites are)
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("out", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
           "qkv_proj": ("qkv", None), "gate_up_proj": ("gate_up", None)}
SITES = ("qkv", "out", "gate_up", "down")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# adapter_config.json fields whose non-default values we cannot honour, and why (one line each)
_REFUSED = {
    "use_dora": (False, "DoRA adapters are not served (use_dora)"),
    "fan_in_fan_out": (False, "fan_in_fan_out adapters (Conv1D bases) are not served"),
    "bias": ("none", "adapters with trained biases (bias != none) are not served"),
    "modules_to_save": (None, "adapters that replace whole modules (modules_to_save) are not served"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern) are not served"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern) are not served"),
}

Folds = dict[str, tuple[torch.Tensor | float | None, torch.Tensor | float | None]]


def fold(folds: Folds, site: str, input: torch.Tensor | float | None = None,  # noqa: A002 (the factor's role)
         output: torch.Tensor | float | None = None) -> None:
    """Record that ``site``'s input was divided by ``input`` (per input channel) and its output multiplied by
    ``output`` (per output channel) in the model's weights, on top of what was folded before."""
    old_in, old_out = folds.get(site, (None, None))
    folds[site] = (_times(old_in, input), _times(old_out, output))


def _times(a: torch.Tensor | float | None, b: torch.Tensor | float | None) -> torch.Tensor | float | None:
    return b if a is None else a if b is None else a * b


@dataclass(frozen=True, slots=True)
class SiteDelta:
    a: torch.Tensor    # [in, rank]: the adapter's A of every module of the site, side by side (input folds in)
    b: torch.Tensor    # [rank, out]: B block by block at each module's output columns (scale and output folds in)


@dataclass(frozen=True, slots=True, eq=False)
class AdapterWeights:
    """One adapter ready to run: its deltas per layer and site. Immutable: a running request keeps the object it
    started with even if the adapter is evicted or reloaded meanwhile."""

    name: str
    fingerprint: bytes            # the prefix cache's seed: KV computed under this adapter is only shared with it
    rank: int
    targets: tuple[str, ...]      # PEFT module names, e.g. ("q_proj", "v_proj")
    deltas: tuple[dict[str, SiteDelta], ...]
    num_bytes: int = 0


class LoraLinear:
    """A Linear of the model plus the deltas of the adapters in the step (module doc)."""

    def __init__(self, base: DenseLinear | Int8DynamicLinear, layer: int, site: str, batch: AdapterBatch) -> None:
        self.base, self.layer, self.site, self.batch = base, layer, site, batch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [rows, out]
        if self.batch.groups:
            for plan in self.batch.plans(self.layer, self.site):
                y.index_add_(0, plan.rows, bag_delta(x.index_select(0, plan.rows), plan))
        return y


def enable_adapters(model) -> AdapterBatch:
    """Wrap the model's targeted Linear layers (after int8 replaced them) in ``LoraLinear``; returns the batch the
    runner fills each step. MoE layers' experts are not wrapped (an adapter targeting them is refused)."""
    batch = AdapterBatch()
    for index, layer in enumerate(model.layers):
        layer.qkv = LoraLinear(layer.qkv, index, "qkv", batch)
        layer.out = LoraLinear(layer.out, index, "out", batch)
        mlp = layer.mlp
        if hasattr(mlp, "gate_up") and hasattr(mlp, "down"):
            mlp.gate_up = LoraLinear(mlp.gate_up, index, "gate_up", batch)
            mlp.down = LoraLinear(mlp.down, index, "down", batch)
    model.adapter_batch = batch
    return batch


def linear_dims(linear: object) -> tuple[int, int]:
    """``(out, in)`` of a Linear of the model, whatever it became at load."""
    base = linear.base if isinstance(linear, LoraLinear) else linear
    if isinstance(base, Int8DynamicLinear):
        return base.out_features, base.in_features
    return tuple(base.weight.shape)


def part_sizes(model, layer: object, site: str) -> list[int]:
    """The output rows of each module fused into ``site`` (q, k, v; gate, up; or the one module)."""
    s = model.shape
    out, _in = linear_dims(_site_linear(layer, site))
    if site == "qkv":
        return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
    return [out // 2, out // 2] if site == "gate_up" else [out]


def _site_linear(layer: object, site: str) -> object:
    if site in ("qkv", "out"):
        return getattr(layer, site)
    if not isinstance(getattr(layer.mlp, site, None), LoraLinear):
        raise KeyError(site)
    return getattr(layer.mlp, site)


def read_adapter_config(folder: Path, max_rank: int) -> dict:
    """adapter_config.json, checked for what we serve: LoRA, rank within ``max_rank``, no refused feature."""
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise BadRequest(f"{folder}: not a PEFT adapter folder (no adapter_config.json)", param="src")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise BadRequest(f"{path}: unreadable ({error})", param="src") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise BadRequest(f"{path}: peft_type {config.get('peft_type')!r}; only LORA adapters are served", param="src")
    for key, (default, reason) in _REFUSED.items():
        if config.get(key, default) not in (default, None, False, {}, []):
            raise BadRequest(f"{path}: {reason}", param="src")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise BadRequest(f"{path}: r must be a positive integer", param="src")
    if rank > max_rank:
        raise BadRequest(f"{path}: rank {rank} is greater than max_lora_rank ({max_rank}, option.max_lora_rank)",
                         param="src")
    return config


def load_adapter(folder: Path, name: str, model, max_rank: int) -> AdapterWeights:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) as ``AdapterWeights`` for ``model``; a
    ``BadRequest`` naming ``src`` for anything that does not fit it (module, layer, shape, rank)."""
    from safetensors.torch import load_file

    config = read_adapter_config(folder, max_rank)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise BadRequest(f"{folder}: no adapter_model.safetensors (pickled adapter_model.bin is not read)",
                         param="src")
    raw = weights_path.read_bytes()
    tensors = load_file(str(weights_path))
    if not tensors:
        raise BadRequest(f"{weights_path} doesn't contain tensors", param="src")
    rank = config["r"]
    scale = config.get("lora_alpha", rank) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs = _pairs(tensors, model, weights_path)
    deltas = tuple(_layer_deltas(model, index, pairs.get(index, {}), scale, weights_path)
                   for index in range(len(model.layers)))
    num_bytes = sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size()
                    for layer in deltas for d in layer.values())
    targets = tuple(sorted({module for layer in pairs.values() for module in layer}))
    fingerprint = hashlib.blake2b(raw + json.dumps(config, sort_keys=True).encode(), digest_size=16).digest()
    return AdapterWeights(name, fingerprint, rank, targets, deltas, num_bytes)


def _pairs(tensors: dict[str, torch.Tensor], model, path: Path) -> dict[int, dict[str, list[torch.Tensor]]]:
    """layer -> PEFT module -> [A ``[r, in]``, B ``[out, r]``], every key checked."""
    pairs: dict[int, dict[str, list]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in MODULES:
            raise BadRequest(f"{path}: the adapter changes {_module_of(key)} ({key}), which adapters cannot change "
                             f"here (served: {', '.join(MODULES)}; not MoE experts or routers)", param="src")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= len(model.layers):
            raise BadRequest(f"{path}: tensor {key} is for layer {layer}; the model has {len(model.layers)}",
                             param="src")
        pairs.setdefault(layer, {}).setdefault(module, [None, None])[0 if which == "A" else 1] = tensor
    for layer, modules in pairs.items():
        for module, (a, b) in modules.items():
            if a is None or b is None:
                raise BadRequest(f"{path}: layer {layer} {module} has lora_A or lora_B missing", param="src")
    return pairs


def _module_of(key: str) -> str:
    """The module a PEFT tensor key changes: ``base_model.model.model.layers.0.mlp.experts.lora_A.weight`` ->
    ``mlp.experts``."""
    module = re.sub(r"\.lora_[AB](\.[\w-]+)?\.weight$", "", key.removeprefix("base_model.model."))
    return re.sub(r"^(model\.)?layers\.\d+\.", "", module)


def _layer_deltas(model, index: int, modules: dict[str, list[torch.Tensor]], scale: float,
                  path: Path) -> dict[str, SiteDelta]:
    layer = model.layers[index]
    deltas = {}
    for site in SITES:
        parts = {MODULES[m][1]: (m, ab) for m, ab in modules.items() if MODULES[m][0] == site}
        if not parts:
            continue
        try:
            sizes = part_sizes(model, layer, site)
        except KeyError:
            raise BadRequest(f"{path}: layer {index} has no dense MLP (an MoE layer): adapters on "
                             f"{', '.join(m for m, _ in parts.values())} are not served there", param="src") from None
        if None in parts:  # the checkpoint's own fused module: one part, the site's every output row
            if len(parts) > 1:
                raise BadRequest(f"{path}: layer {index} has {', '.join(sorted(m for m, _ in parts.values()))} "
                                 "together: a fused module and its parts cannot both be changed", param="src")
            sizes, parts = [sum(sizes)], {0: parts[None]}
        deltas[site] = _site_delta(model, layer, site, sizes, parts, scale, path, index)
    return deltas


def _site_delta(model, layer: object, site: str, sizes: list[int], parts: dict, scale: float, path: Path,
                index: int) -> SiteDelta:
    """A side by side ``[in, R]``, B block-diagonal ``[R, out]`` (zero where a module is not targeted)."""
    _out, in_dim = linear_dims(_site_linear(layer, site))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    a_blocks, b_blocks = [], []
    for part in sorted(parts):
        module, (a, b) = parts[part]
        if a.shape[1] != in_dim or b.shape[0] != sizes[part] or a.shape[0] != b.shape[1]:
            raise BadRequest(f"{path}: layer {index} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                             f"do not fit the model's {module} ({sizes[part]} x {in_dim}): an adapter of another "
                             "base model?", param="src")
        block = torch.zeros(a.shape[0], sum(sizes), dtype=torch.float32)
        block[:, offsets[part]:offsets[part] + sizes[part]] = b.float().T * scale
        a_blocks.append(a.float().T)
        b_blocks.append(block)
    a, b = torch.cat(a_blocks, dim=1), torch.cat(b_blocks)
    in_fold, out_fold = layer.folds.get(site, (None, None))
    if in_fold is not None:
        a = a * (in_fold.float()[:, None] if isinstance(in_fold, torch.Tensor) else in_fold)
    if out_fold is not None:
        b = b * (out_fold.float()[None, :] if isinstance(out_fold, torch.Tensor) else out_fold)
    dtype, device = model.dtype, model.device
    return SiteDelta(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
