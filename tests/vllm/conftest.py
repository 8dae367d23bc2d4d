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
    from tests.e2e.conftest import client, url  # noqa: F401 (the fixtures the reused modules ask for)

    # start_server passes the environment on to every server. The servers that modules start for themselves run
    # eager: ~50 s to start instead of ~127 s (measured here: torch.compile), and compiling changes no answer the
    # contract checks. The session's server, which most of the contract runs against, runs as shipped (below).
    os.environ["OPTION_ROLLING_BATCH"] = "vllm"
    os.environ.setdefault("OPTION_ENFORCE_EAGER", "true")
    e2e.wait_for_ping.__defaults__ = (VLLM_START_TIMEOUT_S,)

    import pytest

    @pytest.fixture(scope="session")
    def server(tmp_path_factory: pytest.TempPathFactory):
        """The session's server on vLLM's shipped default (option.enforce_eager unset: torch.compile)."""
        eager = os.environ.pop("OPTION_ENFORCE_EAGER", None)
        try:
            running = e2e.start_server(tmp_path_factory.mktemp("server"))
        finally:
            if eager is not None:
                os.environ["OPTION_ENFORCE_EAGER"] = eager
        yield running
        e2e.stop_server(running)

    @pytest.fixture(scope="module")
    def fp32_url(url: str) -> str:  # noqa: F811 (the e2e fixture of that name starts a server of its own)
        """The e2e tests that compare with transformers' fp32 numbers: vLLM serves fp32 on this CPU already."""
        return url
