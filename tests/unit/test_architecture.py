"""The import directions docs/ARCHITECTURE.md describes, checked on the source (AST, nothing imported): the layers
of the server, the rooms inside the engine, the front door's endpoints (one module per API, none importing
another), no import circles anywhere in the package, and the sizes of files and classes. Every import counts,
those inside functions and under ``TYPE_CHECKING`` too: a circle drawn only for the type checker is still a
circle a reader has to follow.

A failure names the module, what it imports and the rule: fix the import (or, when the design changed, the
layers and rooms here and in docs/ARCHITECTURE.md together).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "handler"

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS = [
    ("base", ["handler.errors", "handler.config", "handler.config_sources", "handler.knobs", "handler.start_cache",
              "handler.threads"]),
    ("engine", ["handler.engine"]),
    ("metrics", ["handler.metrics"]),
    ("process", ["handler.process"]),
    ("parsing", ["handler.parsing"]),
    ("prompt", ["handler.prompt", "handler.images"]),
    ("wire", ["handler.protocol", "handler.formatting"]),
    ("wiring", ["handler.service", "handler.request_log", "handler.djl", "handler.download",
                "handler.adapter_registry", "handler.sessions",
                "handler.store"]),
    ("endpoints", ["handler.endpoints"]),
    ("entry", ["handler.__main__", "handler.server", "handler.djl.routes", "handler.assemble_model"]),
]
# What the rest of the server may use of the engine: the request and event types, the backend interface, and the
# loader (which backend serves a folder, and building it).
ENGINE_API = {"handler.engine.types", "handler.engine.backend", "handler.engine.loader"}
# The forced-call grammar must lay JSON out exactly as the engine's grammar compiler does, and gpt-oss's forced call
# must allow the same free harmony messages as the engine's reasoning gate (``HARMONY_MESSAGES``).
ENGINE_SHARED = {"handler.parsing.grammars": {"handler.engine.core.json_rules", "handler.engine.core.grammars"}}
# Libraries the engine must not know: it talks to the server through events and a stats listener only.
ENGINE_FORBIDDEN_LIBRARIES = {"flask", "werkzeug", "gunicorn", "prometheus_client", "pydantic"}

# The engine's rooms and what each may import of the engine (besides itself). ``loader`` builds backends and may
# import any room; ``types`` and ``backend`` are the boundary and import only ``types``.
ENGINE = "handler.engine"
ROOMS = {
    "core": {"types", "backend"},
    "model": {"types"},
    "runners": {"types", "core", "model"},
    "lean": {"types", "backend", "core", "runners", "model"},
    "vllm": {"types", "backend", "core", "model.vision"},
}
BACKENDS = ("lean", "vllm")
# What a room may not import of the base layer, narrower than the layers' rule: the model code is given what it needs
# of the settings as arguments (by ``lean.load``), and reads its kernels' environment knobs in ``handler.knobs``.
ROOMS_FORBIDDEN = {"model": {"handler.config"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module the file imports (``from handler.x import y`` also counts ``handler.x.y``, which is a module
    when ``y`` is one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module.startswith("handler"):
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def layer_of(module: str) -> int | None:
    """The layer of the longest prefix naming the module (``handler.djl.routes`` is entry, the rest of
    ``handler.djl`` wiring)."""
    found = [(len(p), index) for index, (_name, prefixes) in enumerate(LAYERS) for p in prefixes
             if module == p or module.startswith(p + ".")]
    return max(found)[1] if found else None


MODULES = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}
# imports of other modules of the package (``from handler.x import name`` keeps ``handler.x`` for a plain name)
EDGES = {m: {t for t in imports if t in MODULES and t != m} for m, imports in MODULES.items()}


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
    engine_imports = {t for t in EDGES[module] if t.startswith("handler.engine.")}
    allowed = ENGINE_API | ENGINE_SHARED.get(module, set())
    assert engine_imports <= allowed, f"{module} reaches into the engine: {sorted(engine_imports - allowed)}"


def room_of(module: str) -> str | None:
    """``core``, ``model``, ... for a module inside a room of the engine; None for the engine's top modules."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["handler", "engine"] and parts[2] in ROOMS else None


def test_every_engine_module_is_in_a_room_or_is_the_boundary_or_the_loader() -> None:
    # ``prepare`` computes ahead what a start of the lean engine computes once (``make model``, the image build)
    top = {f"{ENGINE}.{name}" for name in ("types", "backend", "loader", "prepare")} | {ENGINE}
    homeless = [m for m in MODULES if m.startswith(ENGINE + ".") and m not in top and room_of(m) is None
                and m.rsplit(".", 1)[-1] not in ROOMS]
    assert homeless == [], "put these in a room of handler/engine (and say what the room may import)"


ENGINE_MODULES = sorted(m for m in MODULES if room_of(m) is not None)


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_a_room_imports_only_the_rooms_below_it(module: str) -> None:
    own = room_of(module)
    allowed = {f"{ENGINE}.{name}" for name in ROOMS[own] | {own}}
    reached = sorted(t for t in EDGES[module] if t.startswith(ENGINE + ".")
                     and not any(t == a or t.startswith(a + ".") for a in allowed))
    assert reached == [], f"{module} ({own}) imports {reached}; {own} may import {sorted(ROOMS[own])}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_backends_never_import_each_other_and_the_runners_no_backend(backend: str) -> None:
    others = [f"{ENGINE}.{b}" for b in BACKENDS if b != backend]
    for module in (m for m in ENGINE_MODULES if room_of(m) in (backend, "runners", "model", "core")):
        forbidden = [f"{ENGINE}.{backend}"] if room_of(module) != backend else others
        hits = sorted(t for t in EDGES[module] if any(t == f or t.startswith(f + ".") for f in forbidden))
        assert hits == [], f"{module} imports {hits}"


def test_the_room_rule_fails_on_a_backend_importing_the_other() -> None:
    """The check itself: a vLLM module importing the lean engine breaks it."""
    module = f"{ENGINE}.vllm.backend"
    edges = EDGES[module] | {f"{ENGINE}.lean.engine"}
    allowed = {f"{ENGINE}.{name}" for name in ROOMS["vllm"] | {"vllm"}}
    assert any(t.startswith(ENGINE + ".") and not any(t == a or t.startswith(a + ".") for a in allowed)
               for t in edges)


def forbidden_imports(module: str, imports: set[str]) -> list[str]:
    """What ``module`` imports that its room may not (``ROOMS_FORBIDDEN``), the room's own package included."""
    room = module.split(".")[2] if module.startswith(ENGINE + ".") else None
    forbidden = ROOMS_FORBIDDEN.get(room, set())
    return sorted(t for t in imports if any(t == f or t.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[:3] == ["handler", "engine", "model"]))
def test_the_model_code_takes_its_settings_as_arguments(module: str) -> None:
    hits = forbidden_imports(module, MODULES[module])
    assert hits == [], f"{module} imports {hits}: pass the model code what it needs of the settings as arguments"


def test_the_settings_rule_fails_on_model_code_importing_the_settings() -> None:
    """The check itself: the int8 Linear importing ``handler.config`` (``from handler import config`` too) breaks
    it."""
    module = f"{ENGINE}.model.linear"
    assert forbidden_imports(module, MODULES[module] | {"handler.config"}) == ["handler.config"]
    assert forbidden_imports(f"{ENGINE}.model", {"handler", "handler.config"}) == ["handler.config"]
    assert forbidden_imports(f"{ENGINE}.lean.load", MODULES[f"{ENGINE}.lean.load"]) == []


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle found by a depth-first walk (each as the modules around it)."""
    found, state, path = [], {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    return found


def test_no_import_circles_in_the_package() -> None:
    assert circles(EDGES) == []


def test_the_circle_check_finds_one() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


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
    for module in ("handler.engine.types", "handler.engine.backend"):
        assert "torch" not in {t.split(".")[0] for t in MODULES[module]}, module


def test_the_loader_imports_no_torch_or_vllm_until_a_backend_is_built() -> None:
    """The server's master process asks the loader about folders (preflight) before any worker: module-level imports
    only (those inside functions run when a backend is built)."""
    tree = ast.parse((PACKAGE / "engine" / "loader.py").read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            top.add(node.module)
    assert not {"torch", "vllm", "transformers"} & {t.split(".")[0] for t in top}
    assert not any(t.startswith(ENGINE + ".") and t not in ENGINE_API | {f"{ENGINE}.core.tokenizer"} for t in top)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("handler.formatting")))
def test_formatters_read_output_through_parsing_not_the_prompt_layer(module: str) -> None:
    assert not any(t.startswith("handler.prompt") for t in MODULES[module]), f"{module} imports handler.prompt"


# ---- the front door: one module per API ------------------------------------------------------------------------
# A new API (sessions, a bidirectional stream, rerank, ...) is one module in handler/endpoints/ with one Endpoint
# subclass, and its lines in server.route_table. Endpoint modules share only the base (the moves every route makes)
# and the body reader: never one another, so each API reads alone.
ENDPOINTS = "handler.endpoints"
ENDPOINTS_SHARED = {f"{ENDPOINTS}.base", f"{ENDPOINTS}.body"}
ENDPOINT_MODULES = sorted(m for m in MODULES if m.startswith(ENDPOINTS + ".") and m not in ENDPOINTS_SHARED)
# server.py: the app, the route table, and the hooks around every request; no route function of its own
SERVER_FUNCTIONS = {"route_table", "create_app", "_with_call", "open_call", "close_call", "unanswered_error"}


def _source(module: str) -> ast.Module:
    path = ROOT / (module.replace(".", "/") + ".py")
    return ast.parse(path.read_text())


@pytest.mark.parametrize("module", ENDPOINT_MODULES)
def test_endpoints_never_import_one_another(module: str) -> None:
    others = sorted(t for t in EDGES[module] if t.startswith(ENDPOINTS + ".") and t not in ENDPOINTS_SHARED)
    assert others == [], f"{module} imports {others}: what two endpoints share belongs in endpoints/base.py"


@pytest.mark.parametrize("module", ENDPOINT_MODULES)
def test_each_endpoint_module_is_one_api_in_the_route_table(module: str) -> None:
    endpoints = [node.name for node in ast.walk(_source(module)) if isinstance(node, ast.ClassDef)
                 and any(isinstance(base, ast.Name) and base.id == "Endpoint" for base in node.bases)]
    assert len(endpoints) == 1, f"{module} defines {endpoints}: one Endpoint subclass per module"
    assert module in MODULES["handler.server"], f"{module} is not in server.route_table"


def test_server_keeps_only_the_app_the_route_table_and_the_hooks() -> None:
    tree = _source("handler.server")
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert functions <= SERVER_FUNCTIONS, f"{sorted(functions - SERVER_FUNCTIONS)}: put routes in an endpoint"
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert classes == ["Route"], f"server.py defines {classes}: an API's class belongs in handler/endpoints/"


def test_the_bidirectional_stream_is_one_endpoint_module_the_worker_only_hands_sockets_to() -> None:
    """SageMaker's bidirectional stream (a WebSocket) is one module in handler/endpoints/ and its lines in the route
    table; the worker's part is to hand the upgrade's socket over (``process.handover``), so the WebSocket library
    is that module's alone."""
    users = sorted(m for m, targets in MODULES.items() if any(t.split(".")[0] == "websockets" for t in targets))
    assert users == [f"{ENDPOINTS}.bidirectional"], users
    assert f"{ENDPOINTS}.bidirectional" in MODULES["handler.server"]
    assert not any(t.startswith(ENDPOINTS) for t in MODULES["handler.process.handover"])


def test_the_endpoint_rule_fails_on_one_endpoint_importing_another() -> None:
    """The check itself: chat importing the legacy endpoint breaks it."""
    edges = EDGES[f"{ENDPOINTS}.chat"] | {f"{ENDPOINTS}.legacy"}
    assert any(t.startswith(ENDPOINTS + ".") and t not in ENDPOINTS_SHARED for t in edges)


# ---- sizes ------------------------------------------------------------------------------------------------------
MAX_FILE_LINES, MAX_CLASS_LINES = 400, 250
# Units over a limit, each with why it is; the test prints them. One over a limit and not named here fails, and so
# does one named here that is no longer over (take its entry off).
SIZE_EXCEPTIONS: dict[str, str] = {}


def _sizes() -> dict[str, int]:
    """Every file of handler/ over ``MAX_FILE_LINES`` lines and every class over ``MAX_CLASS_LINES``."""
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(ROOT))
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            over[name] = len(source.splitlines())
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                over[f"{name}:{node.name}"] = node.end_lineno - node.lineno + 1
    return over


def test_no_file_over_400_lines_and_no_class_over_250_but_the_named_exceptions() -> None:
    over = _sizes()
    print(f"\nnamed exceptions to {MAX_FILE_LINES} lines a file, {MAX_CLASS_LINES} a class:")
    for unit, reason in sorted(SIZE_EXCEPTIONS.items()):
        print(f"  {unit} ({over.get(unit, 'no longer over')} lines): {reason}")
    unnamed = {unit: lines for unit, lines in over.items() if unit not in SIZE_EXCEPTIONS}
    assert unnamed == {}, "split these by a real seam (or name them in SIZE_EXCEPTIONS, with why)"
    stale = sorted(set(SIZE_EXCEPTIONS) - set(over))
    assert stale == [], "these are within the limits now: take them off SIZE_EXCEPTIONS"
