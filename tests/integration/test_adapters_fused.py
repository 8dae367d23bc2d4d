"""Adapters on checkpoints whose projections are fused, and on MoE models, against PEFT's own forward.

phi3 stores q, k and v as one ``qkv_proj`` and gate and up as one ``gate_up_proj``, so a PEFT adapter for phi3 has
one A and B for each: it must change the whole fused site, and give PEFT's tokens (fp32) for the adapter and the base
in one batch. On an MoE model (qwen3_moe, whose experts transformers stores as fused 3-D parameters) an adapter on
attention is served and must give PEFT's tokens too, while one that changes the experts or the router is refused at
registration with a 400 naming the module: it is never served without its expert deltas.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from handler.errors import BadRequest
from tests.integration.test_adapters import lora_engine, request, tokens_and_logprobs
from tests.support.tiny_adapters import build_adapter, peft_greedy
from tests.support.tiny_checkpoints import build_tiny

NUM_TOKENS = 8
PROMPTS = {"fused": list(range(300, 340)), None: list(range(700, 735))}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def served_in_one_batch(engine, name: str) -> dict[str | None, list[int]]:
    handles = {adapter: engine.submit(request(f"r-{adapter}", adapter and name, prompt))
               for adapter, prompt in PROMPTS.items()}
    return {adapter: tokens_and_logprobs(handle)[0] for adapter, handle in handles.items()}


def test_phi3s_fused_qkv_and_gate_up_adapter_gives_pefts_tokens(tmp_path: Path) -> None:
    base = build_tiny(tmp_path / "phi3", "phi3")
    adapter = build_adapter(base, tmp_path / "fused", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], rank=8,
                            alpha=16, seed=5)
    reference = peft_greedy(base, {"fused": adapter}, PROMPTS, NUM_TOKENS)
    engine = lora_engine(base, quantize=False)
    try:
        info = engine.adapters.register("fused", str(adapter))
        assert set(info.targets) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
        served = served_in_one_batch(engine, "fused")
    finally:
        engine.stop()
    assert served["fused"] == reference["fused"][0]
    assert served[None] == reference[None][0]
    assert served["fused"] != served[None]


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("moe") / "base", "qwen3_moe", **MOE)


def test_an_attention_adapter_on_an_moe_model_gives_pefts_tokens(moe_base: Path, tmp_path: Path) -> None:
    adapter = build_adapter(moe_base, tmp_path / "attention", ["q_proj", "k_proj", "v_proj", "o_proj"], rank=4,
                            alpha=8, seed=6)
    reference = peft_greedy(moe_base, {"fused": adapter}, PROMPTS, NUM_TOKENS)
    engine = lora_engine(moe_base, quantize=False)
    try:
        engine.adapters.register("attention", str(adapter))
        served = served_in_one_batch(engine, "attention")
    finally:
        engine.stop()
    assert served["fused"] == reference["fused"][0] != served[None]
    assert served[None] == reference[None][0]


@pytest.mark.parametrize(("targets", "config", "module"), [
    (["q_proj"], {"target_parameters": ["mlp.experts.gate_up_proj"]}, "mlp.experts"),
    (["gate"], {}, "mlp.gate"),
])
def test_an_adapter_on_moe_experts_or_router_is_refused_naming_the_module(
        moe_base: Path, tmp_path: Path, targets: list[str], config: dict, module: str) -> None:
    adapter = build_adapter(moe_base, tmp_path / "experts", targets, rank=4, alpha=8, seed=7, **config)
    engine = lora_engine(moe_base, quantize=False)
    try:
        with pytest.raises(BadRequest) as error:
            engine.adapters.register("experts", str(adapter))
        names = [info.name for info in engine.adapters.list()]
    finally:
        engine.stop()
    assert error.value.param == "src" and "\n" not in error.value.message
    assert f"the adapter changes {module} (" in error.value.message, error.value.message
    assert names == []
