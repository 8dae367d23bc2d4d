"""What one sequence's transformers cache holds on the transformers path (``own_caches.CacheCost``), found at load,
so the KV budget counts each family as it keeps its state.

- Measured (the usual): a fresh cache of the model, fed a 2-token prompt and then 2 single tokens as the runner
  steps it, is read after 2 and 4 positions, whatever the model keeps its state in: a ``Cache``'s layers (keys and
  values of every KV head, a sliding or chunked window that stops growing, a linear-attention layer's conv and
  recurrent states, a hybrid layer's both, layers that share another's cache holding nothing) or the tensors of a
  cache without layers (rwkv's ``state``, xlstm's ``xLSTMCache``). Attention grows a position at a time; a recurrent
  state (mamba's, falcon_mamba's) is the same size at every length; a hybrid (jamba, bamba, falcon_h1, ...) is the
  sum of its layers.
- Nothing: a model stepped without a cache (``Stepping.cached`` false) keeps none between forwards.
- Counted from the config (``config_cost``) when the probe cannot run (a vision-language model whose text-only
  probe fails): per layer type, keys and values of every attention layer's KV heads at every position (within its
  window), and a recurrent layer's conv and SSM states from the Mamba-style fields.

A model whose cost neither way can tell (the config lacks the fields its layers need, or a recurrent layer's state
is kept somewhere its cache does not show) is refused at start with ``UnknownCost``: one line naming the model type
and why, rather than served under a budget that counts too little.
"""

from __future__ import annotations

import logging
import math

import torch

from handler.engine.model.support import UnsupportedModel
from handler.engine.runners.own_caches import CacheCost, LayerCost, layer_bytes, window_of

log = logging.getLogger(__name__)

ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding"}
WINDOWED_LAYERS = {"sliding_attention", "chunked_attention", "hybrid_sliding"}
RECURRENT_LAYERS = {"linear_attention", "conv", "hybrid", "hybrid_sliding"}
# a Mamba-style recurrent layer's sizes under the names the families' configs give them
STATE_FIELDS = {"d_state": ("state_size", "mamba_d_state", "ssm_state_size"),
                "d_conv": ("conv_kernel", "mamba_d_conv"),
                "expand": ("expand", "mamba_expand"),
                "groups": ("n_groups", "mamba_n_groups", "mamba_ngroups")}
# the inner (SSM) width: named, or heads times head size, or the expansion of the hidden size; the largest counts
INNER_FIELDS = (("mamba_d_ssm",), ("mamba_num_heads", "mamba_head_dim"), ("mamba_n_heads", "mamba_d_head"))
STATE_ELEMENT = 4  # bytes: states are counted in float32 (some families keep them so whatever the model's dtype)


class UnknownCost(UnsupportedModel):
    """What a sequence's cache holds cannot be known: the model is refused at start (the message says why)."""


def cache_cost(runner) -> CacheCost:
    """The cost of one sequence's cache under ``runner`` (a ``TransformersRunner`` whose stepping is chosen)."""
    model_type = runner.model.config.model_type
    if not runner.vision and not runner.stepping.cached:
        return CacheCost(())
    try:
        cost = _measured(runner)
    except Exception as error:  # noqa: BLE001 (any failure: counted from the config)
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        log.warning("transformers path: the KV budget is counted from the config (the probe failed: %s)", reason)
        return config_cost(runner.model.config, runner.model.dtype, f"its cache could not be probed ({reason})")
    check_states(cost, runner.model.config, model_type)
    return cost


@torch.inference_mode()
def _measured(runner) -> CacheCost:
    """Each layer's bytes after 2 and 4 positions (``CacheCost.between``)."""
    if runner.vision:
        return _measured_vision(runner)
    cache, sizes = runner._new_cache(), []
    for start, token_ids in ((0, [1, 2]), (2, [3]), (3, [4])):
        cache = runner.forward_cached(cache, token_ids, start)[1]
        if start != 2:
            sizes.append(layer_bytes(cache))
    return CacheCost.between(sizes[0], sizes[1], (2, 4), _windows(cache, len(sizes[0])))


def _measured_vision(runner) -> CacheCost:
    """A VLM's text-only probe: its own position ids (qwen2_vl's are 3-D), its per-prompt state put back after."""
    saved = [m.rope_deltas for m in runner.generations.stateful]
    try:
        cache, sizes = runner._new_cache(), []
        for start in (0, 2):
            positions = torch.arange(start, start + 2, device=runner.device)
            output = runner.model(input_ids=torch.tensor([[1, 2]], device=runner.device), past_key_values=cache,
                                  cache_position=positions, use_cache=True, logits_to_keep=1)
            cache = output.past_key_values
            sizes.append(layer_bytes(cache))
    finally:
        for module, value in zip(runner.generations.stateful, saved, strict=True):
            module.rope_deltas = value
    return CacheCost.between(sizes[0], sizes[1], (2, 4), _windows(cache, len(sizes[0])))


def _windows(cache: object, num_layers: int) -> list[int | None]:
    layers = getattr(cache, "layers", None)
    return [window_of(layer) for layer in layers] if layers is not None else [None] * num_layers


def check_states(cost: CacheCost, config, model_type: str) -> None:
    """A layer the config calls recurrent that the measured cache shows empty keeps its state elsewhere (on the
    model's modules, shared by every sequence): no count of it can be trusted."""
    kinds = _layer_kinds(config.get_text_config(decoder=True))
    if kinds is None or len(kinds) != len(cost.layers):
        return
    empty = [index for index, ((kind, _), layer) in enumerate(zip(kinds, cost.layers, strict=True))
             if kind in RECURRENT_LAYERS and layer.fixed == 0]
    if empty:
        raise UnknownCost(f"model_type {model_type!r}: the KV budget cannot count its recurrent layers' state: "
                          f"layers {empty} keep it outside the cache the model hands back")


def config_cost(config, dtype: torch.dtype, why: str = "") -> CacheCost:
    """Per layer from the (text) config: keys and values of every attention layer's KV heads at every position
    (within its window), and a recurrent layer's conv and SSM states (``STATE_FIELDS``). ``UnknownCost`` when the
    config lacks what its layers need (``why``: why the count comes from the config)."""
    text = config.get_text_config(decoder=True)
    kinds = _layer_kinds(text) or [("full_attention", None)] * int(_size(text, "num_hidden_layers") or 0)
    element = torch.empty(0, dtype=dtype).element_size()
    try:
        if not kinds:
            raise LookupError("its config names no layers (num_hidden_layers)")
        per_position = _kv_bytes(text, element) if any(k in ATTENTION_LAYERS for k, _ in kinds) else 0
        fixed = _state_bytes(text) if any(k in RECURRENT_LAYERS for k, _ in kinds) else 0
    except LookupError as missing:
        reason = f"model_type {config.model_type!r}: the KV budget cannot count its cache: {missing.args[0]}"
        raise UnknownCost(f"{reason} ({why})" if why else reason) from None
    unknown = sorted({kind for kind, _ in kinds} - ATTENTION_LAYERS - RECURRENT_LAYERS - {"dummy"})
    if unknown:
        reason = f"model_type {config.model_type!r}: the KV budget cannot count its {', '.join(unknown)} layers"
        raise UnknownCost(f"{reason} from its config ({why})" if why else f"{reason} from its config")
    return CacheCost(tuple(LayerCost(fixed if kind in RECURRENT_LAYERS else 0,
                                     per_position if kind in ATTENTION_LAYERS else 0, window)
                           for kind, window in kinds))


def _layer_kinds(text) -> list[tuple[str, int | None]] | None:
    """Each layer's cache type and window as transformers' ``DynamicCache`` builds it from the config (None when
    it cannot tell)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    try:
        types, kwargs = get_layer_types_and_kwargs(text)
    except Exception:  # noqa: BLE001 (a config this version of the helper cannot read)
        return None
    return [(kind, extra.get("sliding_window") if kind in WINDOWED_LAYERS else None)
            for kind, extra in zip(types, kwargs, strict=True)]


def _kv_bytes(text, element: int) -> int:
    """Keys and values of one attention layer's KV heads, a position."""
    heads = _size(text, "num_attention_heads")
    if not heads:
        raise LookupError("its config has no num_attention_heads for keys and values, nor layer_types naming "
                          "layers that keep other state")
    kv_heads = _size(text, "num_key_value_heads") or heads
    head_dim = _size(text, "head_dim") or (_size(text, "hidden_size") or 0) // heads
    return int(2 * kv_heads * head_dim * element)


def _state_bytes(text) -> int:
    """One Mamba-style layer's conv state ``[inner + 2 * groups * d_state, d_conv]`` and SSM state ``[inner,
    d_state]`` (mamba's ``[intermediate, state_size]``, mamba2's ``[heads, head_dim, state_size]``)."""
    found = {name: next((_size(text, f) for f in fields if _size(text, f)), None)
             for name, fields in STATE_FIELDS.items()}
    inner = max([math.prod(_size(text, f) or 0 for f in fields) for fields in INNER_FIELDS]
                + [int((found["expand"] or 0) * (_size(text, "hidden_size") or 0))])
    if not (found["d_state"] and found["d_conv"] and inner):
        wanted = [fields[0] for name, fields in STATE_FIELDS.items() if name != "groups" and not found[name]]
        raise LookupError(f"its recurrent layers' state needs {', '.join(wanted)} (Mamba-style fields), which its "
                          "config does not have")
    conv = (inner + 2 * (found["groups"] or 0) * found["d_state"]) * found["d_conv"]
    return int(conv + inner * found["d_state"]) * STATE_ELEMENT


def _size(config, name: str) -> int | float | None:
    """A positive size the config has under ``name``, else None (a per-layer field read globally raises)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # noqa: BLE001 (transformers' AmbiguousGlobalPerLayerAttributeError and the like)
        return None
    return value if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None
