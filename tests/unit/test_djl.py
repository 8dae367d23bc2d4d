"""Loading a user's handler: which ones ask for the built-in engine (those that can reach ``builtin_handle``), where
an entry point is found, what a handler that cannot load says, and ``async def handle``."""

from __future__ import annotations

from pathlib import Path

import pytest

from handler.djl import Input
from handler.djl.loading import HandlerLoadError, UserHandler, find_entry_point
from handler.errors import ConfigError


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


def test_an_async_handle_runs_on_one_loop(tmp_path: Path) -> None:
    """LMI's newer handlers are ``async def handle``; each call runs on the same event loop."""
    path = tmp_path / "model.py"
    path.write_text("import asyncio\nfrom djl_python import Input, Output\nloops = set()\n"
                    "async def handle(inputs: Input):\n    loops.add(id(asyncio.get_running_loop()))\n"
                    "    await asyncio.sleep(0)\n    return None if inputs.is_empty() else "
                    "Output().add_as_json({'loops': len(loops)})\n")
    handler = UserHandler(str(path), {})
    handler.initialise()
    assert handler(Input(b"{}", "application/json")).get_as_json() == {"loops": 1}
    assert handler(Input(b"{}", "application/json")).get_as_json() == {"loops": 1}


@pytest.mark.parametrize(("source", "message"), [
    ("from no_such_module import x\ndef handle(inputs):\n    return None\n",
     "failed to load: ModuleNotFoundError: No module named 'no_such_module'"),
    ("def handle(inputs)\n    return None\n", "failed to load: SyntaxError: "),
    ("def other(inputs):\n    return None\n", "has no handle(inputs) function"),
])
def test_a_handler_that_cannot_load_is_one_line_naming_the_file(tmp_path: Path, source: str, message: str) -> None:
    path = tmp_path / "model.py"
    path.write_text(source)
    with pytest.raises(HandlerLoadError) as info:
        UserHandler(str(path), {})
    assert str(path) in str(info.value) and message in str(info.value) and "\n" not in str(info.value)


def test_a_relative_entry_point_file_is_in_the_model_directory(tmp_path: Path) -> None:
    (tmp_path / "my_handler.py").write_text("def handle(inputs):\n    return None\n")
    assert find_entry_point(tmp_path, "my_handler.py") == str(tmp_path / "my_handler.py")
    assert find_entry_point(tmp_path, "some.module") == "some.module"
    assert find_entry_point(tmp_path, None) is None
    (tmp_path / "model.py").write_text("def handle(inputs):\n    return None\n")
    assert find_entry_point(tmp_path, None) == str(tmp_path / "model.py")
    assert find_entry_point(tmp_path, "djl_python.huggingface") is None    # LMI's built-in: ours, not model.py
    with pytest.raises(ConfigError, match="option.entryPoint='missing.py': no such file"):
        find_entry_point(tmp_path, "missing.py")
