"""Markers come from the folder a test lives in (unit / integration / e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest

_FOLDER_MARKERS = {"unit", "integration", "e2e"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, folder))
