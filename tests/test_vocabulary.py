"""One shape for three pipelines: each per-worker loop reads in one screen, without closures in its
loops or exceptions as control flow, the task lives in task.py, and docs/vocabulary.md records
exactly the names raytrain_testkit.vocabulary checks every pipeline's outputs against."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from raytrain_testkit.vocabulary import METRIC_COLUMNS, SUMMARY_KEYS

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = sorted(p.parent for p in (ROOT / "pipelines").glob("[!.]*/pyproject.toml"))
# A loop a newcomer reads in one screen: Ray's tutorial worker is ~40 lines, torchtitan's train()
# ~30 plus its helpers; ours also restore, checkpoint and survive faults through the policies.
MAX_LOOP_LINES = 80


def loop_function(pipeline: Path) -> ast.FunctionDef:
    source = next((pipeline / "src").glob("*/train.py"))
    tree = ast.parse(source.read_text())
    return next(
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "train_loop_per_worker"
    )


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.name)
def test_the_per_worker_loop_reads_in_one_screen(pipeline: Path) -> None:
    loop = loop_function(pipeline)
    assert loop.end_lineno is not None
    length = loop.end_lineno - loop.lineno + 1
    assert length <= MAX_LOOP_LINES, f"{pipeline.name}: train_loop_per_worker is {length} lines"
    for node in ast.walk(loop):
        if isinstance(node, ast.For | ast.While):
            inner = [n for n in ast.walk(node) if isinstance(n, ast.FunctionDef | ast.Lambda)]
            assert not inner, (
                f"{pipeline.name}: a function defined inside a loop (line {node.lineno})"
            )
        if isinstance(node, ast.Try):
            # try/finally to close what the loop opened is fine; catching to steer the loop is not.
            assert not node.handlers, (
                f"{pipeline.name}: except inside the loop (line {node.lineno})"
            )


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.name)
def test_the_task_is_written_once_in_task_py(pipeline: Path) -> None:
    package = next((pipeline / "src").glob("*/task.py")).parent
    task = ast.parse((package / "task.py").read_text())
    names = {node.name for node in task.body if isinstance(node, ast.FunctionDef)}
    assert "build_model" in names
    # Found, not listed: any pipeline folder (a copy under a new name, one of a user's own) is
    # checked the same way. The modules that build the model (the commands that train or score
    # it) take it from task.py and never write the loss again.
    modules = {p.stem: p.read_text() for p in package.glob("*.py") if p.stem != "task"}
    builders = {name: source for name, source in modules.items() if "build_model(" in source}
    assert "train" in builders, f"{pipeline.name}: train.py does not build the model"
    for module, source in builders.items():
        assert f"from {package.name}.task import" in source, f"{module}.py does not use task.py"
        assert "cross_entropy(" not in source, f"{module}.py writes the loss again"
    readme = (pipeline / "README.md").read_text()
    table = readme.split("## Where to change what", 1)[1]
    first_row = re.search(r"^\| `([^`]+)`", table, re.M)
    assert first_row and first_row.group(1).endswith("task.py"), "the table starts with task.py"
    listed = set(re.findall(r"`src/[^`]*?/(\w+\.py)`", table))
    files = {p.name for p in package.glob("*.py")} - {"__init__.py", "__main__.py"}
    assert files <= listed, f"{pipeline.name}: not in 'Where to change what': {files - listed}"


def table_names(markdown: str, heading: str) -> set[str]:
    section = markdown.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z0-9_]+)` \|", section, re.M))


def test_docs_record_exactly_the_names_the_tests_check() -> None:
    doc = (ROOT / "docs" / "vocabulary.md").read_text()
    assert table_names(doc, "summary.json") == set(SUMMARY_KEYS)
    assert table_names(doc, "metrics.csv (and MLflow)") == set(METRIC_COLUMNS)
