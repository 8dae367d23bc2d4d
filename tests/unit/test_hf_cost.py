"""What the transformers path counts for one sequence's cache, from transformers' own configs and cache classes (no
model runs here): a recurrent layer's fixed conv and SSM states, an attention layer's keys and values per position
within its window, a hybrid's both; the tensors of caches without layers; and a cost that cannot be known refused
in one line naming the model type and why."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from handler.engine.runners.hf_cost import UnknownCost, check_states, config_cost
from handler.engine.runners.own_caches import CacheCost, LayerCost, layer_bytes

TINY = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2}
F32 = 4


def cost_of(model_type: str, **fields) -> CacheCost:
    return config_cost(AutoConfig.for_model(model_type, **{**TINY, **fields}), torch.float32)


def test_mamba_is_its_conv_and_ssm_states_whatever_the_length() -> None:
    # inner = expand 2 x hidden 64: conv state [128, conv_kernel 4], SSM state [128, state_size 16], float32
    state = (128 * 4 + 128 * 16) * F32
    cost = cost_of("mamba", state_size=16, conv_kernel=4, expand=2)
    assert cost.layers == (LayerCost(state, 0, None),) * 2
    assert cost.bytes_for(1) == cost.bytes_for(100_000) == 2 * state and cost.bytes_per_token == 0


def test_falcon_mamba_and_mamba2_count_their_own_fields() -> None:
    assert cost_of("falcon_mamba", state_size=16, conv_kernel=4, expand=2).bytes_for(7) == 2 * (128 * 20) * F32
    # mamba2's conv also carries B and C: inner + 2 x groups x state_size channels
    mamba2 = cost_of("mamba2", num_heads=8, head_dim=16, state_size=16, n_groups=1, conv_kernel=4, expand=2)
    assert mamba2.layers[0] == LayerCost(((128 + 2 * 16) * 4 + 128 * 16) * F32, 0, None)


def test_a_hybrid_adds_its_attention_layers_keys_and_values_per_position() -> None:
    cost = cost_of("jamba", attn_layer_period=2, attn_layer_offset=1, num_attention_heads=4, num_key_value_heads=2,
                   mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
    keys_and_values = 2 * 2 * 16 * F32  # 2 KV heads of 64 / 4 = 16
    assert cost.layers == (LayerCost((128 * 4 + 128 * 16) * F32, 0, None), LayerCost(0, keys_and_values, None))
    assert cost.bytes_for(10) == cost.layers[0].fixed + 10 * keys_and_values


def test_a_hybrid_layer_keeps_both_and_a_sliding_layer_stops_at_its_window() -> None:
    falcon_h1 = cost_of("falcon_h1", num_attention_heads=4, num_key_value_heads=2)
    assert all(layer.fixed > 0 and layer.per_position > 0 for layer in falcon_h1.layers)
    # cohere2: three sliding layers in four, then a full one
    cohere2 = cost_of("cohere2", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    keys_and_values = 2 * 2 * 16 * F32
    assert [(layer.per_position, layer.window) for layer in cohere2.layers] == [(keys_and_values, 8)] * 3 + [
        (keys_and_values, None)]
    assert cohere2.bytes_for(100) - cohere2.bytes_for(50) == 50 * keys_and_values  # the full layer alone grows


@pytest.mark.parametrize(("model_type", "fields", "named"), [
    ("rwkv", {}, "no num_attention_heads"),
    ("lfm2", {"layer_types": ["conv", "full_attention"]}, "state_size, conv_kernel, expand"),
    ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"]}, "state_size, conv_kernel, expand"),
    ("deepseek_v32", {}, "its indexed_attention layers"),
])
def test_a_cost_the_config_cannot_tell_is_refused_in_one_line_naming_the_type(model_type: str, fields: dict,
                                                                              named: str) -> None:
    with pytest.raises(UnknownCost) as refused:
        cost_of(model_type, **fields)
    message = str(refused.value)
    assert message.startswith(f"model_type {model_type!r}: the KV budget cannot count its ")
    assert named in message and "\n" not in message


def test_a_recurrent_layer_measured_empty_keeps_its_state_elsewhere_and_is_refused() -> None:
    config = AutoConfig.for_model("mamba", **TINY)
    check_states(CacheCost((LayerCost(10240, 0, None),) * 2), config, "mamba")  # its state, in its cache
    with pytest.raises(UnknownCost, match=r"model_type 'mamba': .* layers \[1\] keep it outside the cache"):
        check_states(CacheCost((LayerCost(10240, 0, None), LayerCost(0, 0, None))), config, "mamba")


def test_caches_without_layers_count_every_tensor_they_hold() -> None:
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    rwkv_state = [torch.zeros(1, 64, 2) for _ in range(5)]  # rwkv's five [batch, hidden, layers] states
    assert layer_bytes(rwkv_state) == [5 * 64 * 2 * F32]
    config = AutoConfig.for_model("xlstm", **TINY)
    cache = xLSTMCache(config, max_batch_size=1, dtype=torch.float32)
    per_layer = config.num_heads * (config.qk_head_dim * config.v_head_dim + config.qk_head_dim + 1) * F32
    assert layer_bytes(cache) == [2 * per_layer + cache.seqlen_offset.element_size()]
    assert layer_bytes(None) == []
