"""The contract tests against the vLLM backend (``make test-vllm``, in .venv-vllm): e2e modules run again here, with
every server they start on ``option.rolling_batch=vllm``. Collected only where vLLM is importable, so the default
``make test`` skips this folder."""

from __future__ import annotations

import importlib.util
import os

# vLLM compiles its model at start: 80-150 s here for the embedded model (measured), more when the CPU is shared
VLLM_START_TIMEOUT_S = 420

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import tests.e2e.conftest as e2e
    from tests.e2e.conftest import client, server, url  # noqa: F401 (the fixtures the reused modules ask for)

    # start_server passes the environment on to every server. Eager mode starts in ~50 s instead of ~127 s (measured
    # here: torch.compile), and compiling changes no answer the contract checks
    os.environ["OPTION_ROLLING_BATCH"] = "vllm"
    os.environ.setdefault("OPTION_ENFORCE_EAGER", "true")
    e2e.wait_for_ping.__defaults__ = (VLLM_START_TIMEOUT_S,)

    import pytest

    @pytest.fixture(scope="module")
    def fp32_url(url: str) -> str:  # noqa: F811 (the e2e fixture of that name starts a server of its own)
        """The e2e tests that compare with transformers' fp32 numbers: vLLM serves fp32 on this CPU already."""
        return url
