"""Which user handlers ask for the built-in engine: those that can reach ``builtin_handle``."""

from __future__ import annotations

from pathlib import Path

import pytest

from handler.djl import UserHandler


@pytest.mark.parametrize(("source", "calls"), [
    ("from handler.djl import builtin_handle\ndef handle(inputs):\n    return builtin_handle(inputs)\n", True),
    ("from handler import djl\ndef handle(inputs):\n    return djl.builtin_handle(inputs)\n", True),
    ("import handler.djl\ndef handle(inputs):\n    return handler.djl.builtin_handle(inputs)\n", True),
    ("from handler.djl import Input, Output\ndef handle(inputs):\n    return Output()\n", False),
    ("def handle(inputs):\n    return None\n", False),
])
def test_calls_builtin(tmp_path: Path, source: str, calls: bool) -> None:
    path = tmp_path / "model.py"
    path.write_text(source)
    assert UserHandler(str(path), {}).calls_builtin is calls
