"""Every setting and every route is documented somewhere: README.md or a page in docs/.

A setting is documented when its serving.properties name (``option.max_model_len``; ``engine`` has no prefix) and
every environment name ``config.ENV_NAMES`` maps onto a setting appear in the docs. A route is documented when its
path (Flask's ``<name>`` variables written ``{anything}``) appears after its method, as the docs write routes
(`` `POST /v1/responses` ``, or a list of methods: `` `GET` / `DELETE /v1/responses/{id}` ``); a WebSocket route
when its path appears in backticks. The routes come from ``server.route_table`` itself, built over a front door
whose service has no user handler (the endpoints only keep the door: nothing is loaded or started).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from handler import config
from handler.endpoints.base import FrontDoor
from handler.server import route_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
METHODS = "GET|POST|PUT|PATCH|DELETE"


def docs_text() -> str:
    return "\n".join(path.read_text() for path in DOCS)


def properties_name(field: str) -> str:
    return field if field == "engine" else f"option.{field}"


def path_pattern(rule: str) -> str:
    """Flask's rule as a regex of the docs' spelling: each ``<name>`` (or ``<converter:name>``) is ``{anything}``."""
    return "".join(r"\{[^}\s]+\}" if part.startswith("<") else re.escape(part)
                   for part in re.split(r"(<[^>]+>)", rule))


def is_documented(method: str, rule: str, websocket: bool, text: str) -> bool:
    path = path_pattern(rule)
    if websocket:
        return re.search(rf"`{path}`", text) is not None
    # the method, possibly among others joined by " / " (with or without backticks), then the path, then its end
    methods = rf"(?:{METHODS})`?(?:\s*/\s*`?(?:{METHODS})`?)*"
    found = re.finditer(rf"\b(?P<methods>{methods})\s+{path}(?=[`\s,;)|]|$)", text)
    return any(method in re.findall(METHODS, match.group("methods")) for match in found)


def routes() -> list[tuple[str, str, bool]]:
    door = FrontDoor(SimpleNamespace(user_handler=None), is_draining=lambda: False)
    return [(route.method, route.rule, route.websocket) for route in route_table(door)]


SETTINGS = [properties_name(field) for field in config.Settings.model_fields]
ENVIRONMENT = list(config.ENV_NAMES)
ROUTES = routes()


def test_the_tables_are_not_empty() -> None:
    assert len(SETTINGS) > 50 and "SAGEMAKER_BIND_TO_PORT" in ENVIRONMENT
    assert ("POST", "/invocations", False) in ROUTES and any(websocket for _, _, websocket in ROUTES)


@pytest.mark.parametrize("name", SETTINGS)
def test_each_setting_is_documented(name: str) -> None:
    assert re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", docs_text()), \
        f"{name} is documented in none of README.md and docs/*.md"


@pytest.mark.parametrize("name", ENVIRONMENT)
def test_each_environment_name_is_documented(name: str) -> None:
    assert re.search(rf"(?<!\w){name}(?!\w)", docs_text()), \
        f"{name} (option.{config.ENV_NAMES[name]}) is documented in none of README.md and docs/*.md"


@pytest.mark.parametrize(("method", "rule", "websocket"), ROUTES,
                         ids=[f"{'WS' if ws else m} {r}" for m, r, ws in ROUTES])
def test_each_route_is_documented(method: str, rule: str, websocket: bool) -> None:
    assert is_documented(method, rule, websocket, docs_text()), \
        f"{method} {rule} is documented in none of README.md and docs/*.md"


@pytest.mark.parametrize(("method", "rule", "text", "expected"), [
    ("GET", "/v1/responses/<response_id>", "`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`", True),
    ("DELETE", "/v1/responses/<response_id>", "`GET` / `DELETE /v1/responses/{id}`", True),
    ("POST", "/v1/responses/<response_id>", "`GET` / `DELETE /v1/responses/{id}`", False),
    ("POST", "/", "`POST /generate`, `POST /`", True),
    ("POST", "/", "`POST /generate`, `GET` / `DELETE /v1/x`", False),
    ("GET", "/v1/models/<path:model_id>", "`GET /v1/models`", False),
])
def test_the_route_matcher(method: str, rule: str, text: str, expected: bool) -> None:
    assert is_documented(method, rule, False, text) is expected
