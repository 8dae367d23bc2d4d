"""LoRA adapters (issue #31) on the vLLM backend, with the e2e tests unchanged: every server they start runs on
``option.rolling_batch=vllm`` (conftest), so registration (POST /adapters through ``VllmAdapters`` and vLLM's
``add_lora``), selection by header, ``model`` and legacy parameters (a ``LoRARequest`` per request), adapters and the
base in one batch giving PEFT's own greedy tokens, the 404 for an unknown adapter, and boto3 through the local
runtime all run on vLLM's LoRA path. The tiny adapters are built with peft (pinned in ci/install_vllm.sh's test
tools).

Left out, and why: the eviction test reads the lean store's ``loaded`` flags and load / evict metrics (vLLM evicts
adapters itself and reports neither: docs/api.md, Adapters), and the int8 test is about the lean engine's int8 rows.

The tiny llama is wider here (hidden 256: head_dim 64) because vLLM's CPU attention serves head sizes from 32 up
(``CPUAttentionBackend.get_supported_head_sizes``) and the e2e one has head_dim 16; ``test_parallel.py`` widens it
the same way."""

from pathlib import Path

import pytest

from tests.e2e.test_adapters import (  # noqa: F401 (the fixtures and tests pytest collects here)
    build_folders,
    fp32_server,
    test_adapters_by_header_model_and_base_in_one_batch_give_pefts_tokens,
    test_boto3_picks_an_adapter_by_its_inference_component,
    test_legacy_parameters_pick_the_adapter,
    test_unknown_adapter_is_a_404_naming_it,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_folders(tmp_path_factory.mktemp("adapters"), hidden_size=256, intermediate_size=512)
