"""A pytest plugin that writes down what a collection found: `pytest --collect-only -q -p
raytrain_testkit.collected` with RAYTRAIN_COLLECTED=FILE writes every collected test's node id
and the names of its markers to FILE as JSON. tests/test_repo.py uses it to check that the CI
command's sessions select every test, and that every test docs/faults.md names exists."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

TARGET = "RAYTRAIN_COLLECTED"


def pytest_collection_finish(session: pytest.Session) -> None:
    target = os.environ.get(TARGET)
    if not target:
        return
    items = [
        {"nodeid": item.nodeid, "markers": sorted({mark.name for mark in item.iter_markers()})}
        for item in session.items
    ]
    Path(target).write_text(json.dumps(items))
