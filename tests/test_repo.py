"""The repo keeps its promises: CI runs the README's test command, sessions exist, pipelines stay copyable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = sorted(p for p in (ROOT / "pipelines").iterdir() if (p / "pyproject.toml").exists())
PACKAGES = [ROOT / "packages" / "common", *PIPELINES]


def readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    section = re.split(r"### \d+\. Run the tests", readme, maxsplit=1)[1]
    return re.search(r"```bash\n(.+?)\n```", section, re.S).group(1).strip()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands[-1] == readme_test_command()


def test_noxfile_has_the_sessions_the_readme_names() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "nox", "-l", "-f", str(ROOT / "noxfile.py")],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    sessions = ("mnist", "mnist_gpu", "bench_mnist", "hf_finetune", "hf_finetune_gpu", "llm_fsdp")
    for session in (
        *sessions,
        "bench_tokenize",
        "bench_llm",
        "tests",
        "tests_gpu",
        "manifests",
        "lint",
    ):
        assert re.search(rf"^[*-] {session}\b", listing.stdout, re.M), listing.stdout


@pytest.mark.parametrize(
    ("session", "cpu_session"),
    [
        ("mnist_gpu", "mnist"),
        ("hf_finetune_gpu", "hf_finetune"),
        ("llm_fsdp_gpu", "llm_fsdp"),
        ("tests_gpu", "tests"),
    ],
)
def test_gpu_session_fails_at_once_without_a_gpu(session: str, cpu_session: str) -> None:
    if (
        subprocess.run(
            ["sh", "-c", "command -v nvidia-smi"], capture_output=True, check=False
        ).returncode
        == 0
    ):
        pytest.skip("this machine has nvidia-smi")
    done = subprocess.run(
        [sys.executable, "-m", "nox", "-s", session, "-f", str(ROOT / "noxfile.py")],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode != 0
    assert f"{session} needs an NVIDIA GPU" in done.stderr + done.stdout
    assert f"nox -s {cpu_session}" in done.stderr + done.stdout


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_package_is_versioned_documented_and_tested(package: Path) -> None:
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    changelog = (package / "CHANGELOG.md").read_text()
    assert f"## {project['version']}" in changelog  # the current version has its entry
    assert (package / "README.md").exists()
    assert list((package / "tests").glob("test_*.py"))
    inits = list((package / "src").glob("*/__init__.py"))
    assert len(inits) == 1
    assert (
        f'__version__ = "{project["version"]}"' in inits[0].read_text()
    )  # summaries report the real version
    pins = [d for d in project["dependencies"] if d.startswith("raytrain-common")]
    common = tomllib.loads((ROOT / "packages/common/pyproject.toml").read_text())["project"]
    for pin in pins:  # the pipelines pin the common package of this tree
        assert pin.endswith(f"=={common['version']}"), pin


def test_common_never_names_a_pipeline() -> None:
    names = [p.name for p in PIPELINES]
    for source in (ROOT / "packages" / "common" / "src").rglob("*.py"):
        text = source.read_text()
        for name in names:
            assert name not in text, f"{source} names the pipeline {name}"


def test_checkpoints_are_never_unpickled_freely() -> None:
    call = "torch" + ".load("  # spelled apart so this file does not match itself
    for source in ROOT.glob("[!.]*/**/*.py"):
        for line in source.read_text().splitlines():
            if call in line:
                assert "weights_only=True" in line, f"{source}: {line.strip()}"
