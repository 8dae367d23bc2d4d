"""The vLLM contract (``tests/vllm/test_contract.py``) star-imports e2e modules into one namespace: a fixture name
defined by two of them would leave one module's tests on the other's server (as ``sdk`` once did: the sealed-reasoning
tests ran against the Responses-state server's model). Each fixture name is defined by one of those modules only."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def star_imported_modules() -> list[str]:
    source = (ROOT / "tests" / "vllm" / "test_contract.py").read_text()
    return [line.split()[1] for line in source.splitlines()
            if line.startswith("from tests.e2e.") and "import *" in line]


def test_the_contract_star_imports_e2e_modules() -> None:
    assert len(star_imported_modules()) >= 5


def test_no_fixture_name_is_defined_by_two_star_imported_modules() -> None:
    owners: dict[str, list[str]] = collections.defaultdict(list)
    for module in star_imported_modules():
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any("fixture" in ast.unparse(d) for d in node.decorator_list):
                owners[node.name].append(module)
    assert {name: where for name, where in owners.items() if len(where) > 1} == {}
