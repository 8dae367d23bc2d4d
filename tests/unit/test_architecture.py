"""The import directions docs/ARCHITECTURE.md describes, checked on the source (AST, nothing imported).

A failure names the module, what it imports and the rule: fix the import (or, when the design changed, the
layers here and in docs/ARCHITECTURE.md together).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "handler"

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS = [
    ("base", ["handler.errors", "handler.config"]),
    ("engine", ["handler.engine"]),
    ("metrics", ["handler.metrics"]),
    ("prompt", ["handler.prompt", "handler.images"]),
    ("wire", ["handler.protocol", "handler.formatting"]),
    ("wiring", ["handler.service", "handler.intake", "handler.request_log", "handler.djl", "handler.preflight"]),
    ("entry", ["handler.__main__", "handler.server", "handler.djl_routes", "handler.lifecycle",
               "handler.disconnect", "handler.assemble_model", "handler.worker"]),
]
# What the rest of the server may use of the engine: the request and event types and the backend interface.
ENGINE_API = {"handler.engine.types", "handler.engine.backend"}
# Modules that build a backend or check a checkpoint, and so reach further into the engine package.
ENGINE_BUILDERS = {"handler.service", "handler.preflight"}
# The forced-call grammar the prompt layer writes must lay JSON out exactly as the engine's grammar compiler does.
ENGINE_SHARED = {"handler.prompt.tool_calls": {"handler.engine.json_rules"}}
# Libraries the engine must not know: it talks to the server through events and a stats listener only.
ENGINE_FORBIDDEN_LIBRARIES = {"flask", "werkzeug", "gunicorn", "prometheus_client", "pydantic"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module the file imports (``from handler import x`` counts as ``handler.x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "handler":
                found.update(f"handler.{alias.name}" for alias in node.names)
    return found


def layer_of(module: str) -> int | None:
    for index, (_name, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


MODULES = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in MODULES if m != "handler" and layer_of(m) is None]
    assert unplaced == [], "put these modules in a layer (tests/unit/test_architecture.py, docs/ARCHITECTURE.md)"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_layer_above_its_own(module: str) -> None:
    own = layer_of(module)
    upward = sorted(t for t in MODULES[module] if t.startswith("handler.") and (layer_of(t) or 0) > (own or 0))
    assert upward == [], f"{module} ({LAYERS[own or 0][0]}) imports a higher layer"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("handler.engine")))
def test_outside_the_engine_only_its_interface_is_imported(module: str) -> None:
    engine_imports = {t for t in MODULES[module] if t.startswith("handler.engine.")}
    allowed = ENGINE_API | ENGINE_SHARED.get(module, set())
    if module in ENGINE_BUILDERS:
        return
    assert engine_imports <= allowed, f"{module} reaches into the engine: {sorted(engine_imports - allowed)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("handler.engine")))
def test_the_engine_knows_no_http_metrics_or_wire_schema(module: str) -> None:
    forbidden = {t.split(".")[0] for t in MODULES[module]} & ENGINE_FORBIDDEN_LIBRARIES
    assert forbidden == set(), f"{module} imports {sorted(forbidden)}"


WIRE_MODULES = sorted(m for m in MODULES if m.startswith(("handler.formatting", "handler.protocol")))


@pytest.mark.parametrize("module", WIRE_MODULES)
def test_parsers_and_formatters_do_not_import_each_other(module: str) -> None:
    other = "handler.protocol" if module.startswith("handler.formatting") else "handler.formatting"
    assert not any(t.startswith(other) for t in MODULES[module]), f"{module} imports {other}"


def test_the_engine_boundary_types_import_no_torch() -> None:
    for module in ENGINE_API:
        assert "torch" not in {t.split(".")[0] for t in MODULES[module]}, module
