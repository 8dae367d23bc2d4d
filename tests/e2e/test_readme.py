"""The README's first examples, run as they are written there, against the default server twice: as this CPU runs
it, and as another CPU would (our int8 kernel held to its AVX2 sums, ``LLM_INT8_KERNEL_ISA=avx2``, and torch's plain
C++ kernels instead of its vector ones, ``ATEN_CPU_CAPABILITY=default``, so attention and norms round their last
bits differently, as another machine's do). Each must answer the question, not only have the right shape: the
README's own question is a near-tie that 8-bit activations once answered wrong under one CPU's rounding and right
under another's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO_ROOT, RunningServer, start_server, stop_server

README = REPO_ROOT / "README.md"


def quick_start_blocks() -> list[tuple[str, str]]:
    """``(language, code)`` of each fenced block between "Then, from another shell" and the next heading."""
    text = README.read_text()
    start = text.index("Then, from another shell")
    section = text[start:text.index("\n## ", start)]
    return re.findall(r"```(bash|python)\n(.*?)```", section, flags=re.DOTALL)


BLOCKS = quick_start_blocks()


@pytest.fixture(scope="module", params=["this-cpu", "other-cpu"])
def readme_server(request: pytest.FixtureRequest, server: RunningServer,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The session's default server, then one with our int8 kernel's AVX2 sums and torch's plain kernels."""
    if request.param == "this-cpu":
        yield server
        return
    other = {"LLM_INT8_KERNEL_ISA": "avx2", "ATEN_CPU_CAPABILITY": "default"}
    running = start_server(tmp_path_factory.mktemp("other-cpu"), other)
    assert "torch dispatch DEFAULT" in running.log() and "our AVX2 kernel" in running.log()
    yield running
    stop_server(running)


def run_block(language: str, code: str, url: str) -> str:
    code = code.replace("localhost:8080", url.removeprefix("http://"))
    command = ["bash", "-c", code] if language == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=Path.cwd())
    assert done.returncode == 0, done.stderr
    return done.stdout


def answer_of(output: str) -> str:
    """The answer text in one block's output: a chat or legacy body, JSON lines of a stream, or printed text."""
    lines = output.strip().splitlines()
    try:
        records = [json.loads(line) for line in lines]
    except json.JSONDecodeError:
        return output
    if len(records) > 1:  # a chat stream: the deltas joined, the last chunk ending it
        assert records[-1]["choices"][0]["finish_reason"] == "stop"
        return "".join(r["choices"][0]["delta"].get("content") or "" for r in records if r["choices"])
    body = records[0]
    if "generated_text" in body:
        return body["generated_text"]
    assert body["choices"][0]["finish_reason"] == "stop"
    return body["choices"][0]["message"]["content"]


def test_the_quick_start_has_chat_legacy_stream_and_sdk_blocks() -> None:
    assert [language for language, _ in BLOCKS] == ["bash", "bash", "bash", "python"]
    assert '"stream":true' in BLOCKS[2][1] and '"inputs"' in BLOCKS[1][1] and "OpenAI(" in BLOCKS[3][1]


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=["chat", "legacy", "stream", "openai-sdk"][:len(BLOCKS)])
def test_readme_example_answers_paris(readme_server: RunningServer, index: int) -> None:
    assert "16-bit activations per block of 128 (the same integers on every CPU)" in readme_server.log()
    answer = answer_of(run_block(*BLOCKS[index], readme_server.url))
    assert "Paris" in answer, answer
