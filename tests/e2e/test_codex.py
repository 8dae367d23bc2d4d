"""Codex CLI (``@openai/codex``, pinned in the Makefile) against the real server: ``codex exec`` with a custom
provider (``wire_api = "responses"``, ``base_url`` the server's ``/v1``), configured through a temporary
``CODEX_HOME``. Its first request (~40 KB: two developer messages, function tools, a ``namespace`` tool, the hosted
``web_search`` tool, ``store: false``, ``include: ["reasoning.encrypted_content"]``, ``reasoning.summary``,
``prompt_cache_key``, ``client_metadata``, streamed) is accepted; Codex parses the stream without an error; the
model's call to ``exec_command`` is run by Codex and its output comes back in a second request, with the reasoning
item sealed as the server gave it, and the model answers it.

The model is ``tests/support/agent_model.py``'s scripted agent (it reasons, calls ``exec_command`` with ``echo hi``,
then answers ``Done.``) with a 32768-token context, since Codex's first request would not fit the embedded model's 8192.
Settings differ from the shipped ones in these, and why: ``option.model_id`` (that model); ``option.max_model_len``
(its whole context: the default caps it at 8192); ``option.log_prompts`` (the second request's items are read from the
request log); ``option.request_timeout=600`` (the first request's ~11k-token prefill on this shared 2-core machine).

Runs where ``CODEX_BIN`` names the binary (``make test-agents`` installs it into a cache outside the clone and sets
it; ``.ci/run`` calls that target); skipped otherwise, so ``make test`` needs no node or npm.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import RunningServer, start_server, stop_server
from tests.support.agent_model import ANSWER, COMMAND, build_agent_llama

CODEX = os.environ.get("CODEX_BIN")
pytestmark = pytest.mark.skipif(not CODEX, reason="CODEX_BIN is not set (make test-agents installs Codex CLI)")
TASK = "Say hi from the shell."


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = build_agent_llama(tmp_path_factory.mktemp("codex-agent") / "model")
    running = start_server(tmp_path_factory.mktemp("codex-server"), env={
        "OPTION_MODEL_ID": str(folder), "OPTION_MAX_MODEL_LEN": "32768", "OPTION_LOG_PROMPTS": "true",
        "OPTION_REQUEST_TIMEOUT": "600"})
    yield running
    stop_server(running)


def run_codex(url: str, home: Path, workdir: Path) -> list[dict]:
    """``codex exec --json`` on ``TASK`` with the server as its provider; its JSON-lines events."""
    assert Path(CODEX).is_file(), f"CODEX_BIN={CODEX} is not a file"
    home.mkdir()
    workdir.mkdir()
    (home / "config.toml").write_text(
        'model = "agent"\nmodel_provider = "sagemaker"\n\n[model_providers.sagemaker]\n'
        f'name = "SageMaker LLM container"\nbase_url = "{url}/v1"\nwire_api = "responses"\n')
    done = subprocess.run([CODEX, "exec", "--json", "--skip-git-repo-check", "--sandbox", "danger-full-access",
                           "--cd", str(workdir), TASK], env={**os.environ, "CODEX_HOME": str(home)},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"codex exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def request_lines(server: RunningServer) -> list[dict]:
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "request" and line["route"] == "/v1/responses"]


def test_codex_runs_a_tool_call_through_the_responses_api(agent_server: RunningServer, tmp_path: Path) -> None:
    events = run_codex(agent_server.url, tmp_path / "codex-home", tmp_path / "work")
    kinds = [event["type"] for event in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, events
    items = [event["item"] for event in events if event["type"] == "item.completed"]
    # Codex's own note that it has no metadata for a model it does not know is the only error item
    assert all(item["message"].startswith("Model metadata for") for item in items if item["type"] == "error")
    (command,) = [item for item in items if item["type"] == "command_execution"]
    assert COMMAND in command["command"] and command["exit_code"] == 0 and command["aggregated_output"] == "hi\n"
    assert [item["text"] for item in items if item["type"] == "agent_message"] == [ANSWER]

    first, second = request_lines(agent_server)
    assert first["status"] == second["status"] == 200 and first["stream"] and second["stream"]
    assert [item["role"] for item in first["prompt"]][:2] == ["developer", "developer"]
    sent_back = {item["type"]: item for item in second["prompt"]}
    assert sent_back["reasoning"]["encrypted_content"]  # the sealed reasoning Codex was given, sent back
    assert sent_back["function_call"]["name"] == "exec_command"
    assert "hi" in json.dumps(sent_back["function_call_output"]["output"])
    assert second["prompt_tokens"] > first["prompt_tokens"] > 8192  # more than the embedded model's context
    assert "tools[8] (type web_search) is a tool this server cannot run" in agent_server.log()
