"""The process's environment knobs (``handler.knobs``): read through the one table, with its defaults, and read
nowhere else in the server (checked on the source, as the architecture test checks imports)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from handler import knobs, start_cache
from handler.knobs import KNOBS, knob, path_knob

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "handler"
READERS = {"knob", "path_knob"}
# build.py run as a file (the image's build stage, without the package) reads its cache folder itself
BUILD = PACKAGE / "engine" / "model" / "kernels" / "build.py"


def test_a_knob_unset_is_its_default_and_set_is_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_INT8_KERNEL_ISA", raising=False)
    assert knob("LLM_INT8_KERNEL_ISA") == "auto"
    monkeypatch.setenv("LLM_INT8_KERNEL_ISA", "avx2")
    assert knob("LLM_INT8_KERNEL_ISA") == "avx2"
    monkeypatch.setenv("LLM_INT8_KERNEL_ISA", "")
    assert knob("LLM_INT8_KERNEL_ISA") == ""  # set but empty is what was set (``!= "avx2"``: auto, as before)


def test_a_folder_knob_defaults_under_the_home_and_takes_a_value_as_written(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    monkeypatch.delenv("LLM_INT8_CACHE", raising=False)
    assert path_knob("LLM_INT8_CACHE") == Path.home() / ".cache" / "sagemaker-llm" / "int8" == start_cache.home()
    monkeypatch.setenv("LLM_INT8_CACHE", str(tmp_path))
    assert start_cache.home() == tmp_path
    monkeypatch.setenv("LLM_KERNEL_CACHE", "~/kept")
    assert path_knob("LLM_KERNEL_CACHE") == Path("~/kept")  # the user's value is not expanded, as before


def test_an_undeclared_knob_is_an_error() -> None:
    with pytest.raises(KeyError):
        knob("LLM_NOT_A_KNOB")


def test_every_knob_has_a_meaning_and_an_llm_name() -> None:
    assert all(name.startswith("LLM_") and entry.meaning for name, entry in KNOBS.items())


def _environment_reads(tree: ast.AST) -> list[str]:
    """``LLM_*`` names read straight from the environment: ``os.environ.get("LLM_X")``, ``os.environ["LLM_X"]``,
    ``os.getenv("LLM_X")``, ``"LLM_X" in os.environ``."""
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            if func.endswith(("environ.get", "getenv", "environ.pop", "environ.setdefault")):
                name = node.args[0].value
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
            name = node.slice.value if isinstance(node.slice, ast.Constant) else None
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and \
                any(ast.unparse(c).endswith("environ") for c in node.comparators):
            name = node.left.value
        if isinstance(name, str) and name.startswith("LLM_"):
            found.append(name)
    return found


def _knob_reads(tree: ast.AST) -> list[str]:
    return [node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args
            and isinstance(node.func, ast.Name) and node.func.id in READERS and isinstance(node.args[0], ast.Constant)]


def _main_block(tree: ast.Module) -> ast.AST | None:
    return next((node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)), None)


def test_the_server_reads_llm_knobs_only_through_the_table() -> None:
    straight, undeclared = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(knobs.__file__):
            continue
        tree = ast.parse(path.read_text())
        reads = _environment_reads(tree)
        if path == BUILD:
            reads = [name for name in reads if name not in _environment_reads(_main_block(tree))]
        if reads:
            straight[str(path.relative_to(ROOT))] = reads
        if missing := [name for name in _knob_reads(tree) if name not in KNOBS]:
            undeclared[str(path.relative_to(ROOT))] = missing
    assert straight == {}, "read these through handler.knobs (and declare them in KNOBS)"
    assert undeclared == {}, "declare these in handler.knobs.KNOBS"


def test_the_read_check_finds_a_straight_read() -> None:
    """The check itself: each way of reading the environment is found."""
    source = ('import os\nos.environ.get("LLM_A", "x")\nos.environ["LLM_B"]\nos.getenv("LLM_C")\n'
              '"LLM_D" in os.environ\nos.environ.get("HOME")\n')
    assert _environment_reads(ast.parse(source)) == ["LLM_A", "LLM_B", "LLM_C", "LLM_D"]


def test_build_run_as_a_file_uses_the_declared_default(tmp_path: Path) -> None:
    """The image's build stage runs build.py alone, without the package: its cache folder is the declared one."""
    main = _main_block(ast.parse(BUILD.read_text()))
    defaults = [node.args[1].value for node in ast.walk(main) if isinstance(node, ast.Call) and len(node.args) == 2
                and ast.unparse(node.func).endswith("environ.get") and node.args[0].value == "LLM_KERNEL_CACHE"]
    assert defaults == [KNOBS["LLM_KERNEL_CACHE"].default]
    alone = tmp_path / "build.py"
    alone.write_text(BUILD.read_text())  # no C sources beside it: it compiles nothing, and imports nothing but stdlib
    result = subprocess.run([sys.executable, "-I", str(alone)],
                            capture_output=True, text=True, env={"LLM_KERNEL_CACHE": str(tmp_path / "k")}, check=False)
    assert "ModuleNotFoundError" not in result.stderr and "ImportError" not in result.stderr, result.stderr
