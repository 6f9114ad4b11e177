"""Prepared data once per machine: one build whatever the number of processes asking, a rebuild
when the key changes or the entry is unfinished or damaged, never a half-written entry used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from raytrain_testkit.prepared import COMPLETE, prepared_once

KEY = {"source": "abc", "packages": "pipeline 1.0"}


def counting_build(log: Path, content: str = "rows") -> Callable[[Path], None]:
    def build(folder: Path) -> None:
        with open(log, "a") as stream:
            stream.write(f"{os.getpid()}\n")
        (folder / "part-0.parquet").write_text(content)
        (folder / "dataset.json").write_text("{}")

    return build


def builds(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_built_once_then_shared_read_only(tmp_path: Path) -> None:
    log = tmp_path / "builds.log"
    first = prepared_once("data", KEY, counting_build(log), root=tmp_path / "cache")
    again = prepared_once("data", KEY, counting_build(log), root=tmp_path / "cache")
    assert first == again and builds(log) == 1
    assert (first / "part-0.parquet").read_text() == "rows"
    assert not os.stat(first / "part-0.parquet").st_mode & 0o222  # no write bit left


def test_a_new_key_is_a_new_build(tmp_path: Path) -> None:
    """A new package version (or source, or option) never reuses the old entry."""
    log = tmp_path / "builds.log"
    old = prepared_once("data", KEY, counting_build(log, "old"), root=tmp_path / "cache")
    new_key = {**KEY, "packages": "pipeline 1.1"}
    new = prepared_once("data", new_key, counting_build(log, "new"), root=tmp_path / "cache")
    assert new != old and builds(log) == 2
    assert (new / "part-0.parquet").read_text() == "new"


def test_unfinished_or_damaged_entries_are_rebuilt(tmp_path: Path) -> None:
    log, cache = tmp_path / "builds.log", tmp_path / "cache"
    entry = prepared_once("data", KEY, counting_build(log), root=cache)

    # A file cut short after the entry was finished: rebuilt, not used.
    os.chmod(entry / "part-0.parquet", 0o644)
    (entry / "part-0.parquet").write_text("ro")
    rebuilt = prepared_once("data", KEY, counting_build(log), root=cache)
    assert (rebuilt / "part-0.parquet").read_text() == "rows"
    assert builds(log) == 2

    # A builder that failed midway left files without complete.json: rebuilt, not used.
    (entry / COMPLETE).unlink()

    def failing(folder: Path) -> None:
        (folder / "part-0.parquet").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        prepared_once("data", KEY, failing, root=cache)
    assert not (entry / COMPLETE).exists()
    rebuilt = prepared_once("data", KEY, counting_build(log), root=cache)
    assert (rebuilt / "part-0.parquet").read_text() == "rows" and builds(log) == 3


BUILDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from raytrain_testkit.prepared import prepared_once

    def build(folder):
        with open(sys.argv[2], "a") as stream:
            stream.write("build\\n")
        (folder / "part-0.parquet").write_text("rows")
        time.sleep(float(sys.argv[3]))

    print(prepared_once("data", {"source": "abc"}, build, root=Path(sys.argv[1])), flush=True)
    """
)


def start_builder(cache: Path, log: Path, sleep_s: float) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", BUILDER, str(cache), str(log), str(sleep_s)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def test_processes_asking_together_share_one_build(tmp_path: Path) -> None:
    cache, log = tmp_path / "cache", tmp_path / "builds.log"
    processes = [start_builder(cache, log, 1.0) for _ in range(3)]
    folders = {process.communicate()[0].strip() for process in processes}
    assert [process.returncode for process in processes] == [0, 0, 0]
    assert len(folders) == 1 and builds(log) == 1


def test_a_builder_killed_midway_blocks_nobody_and_its_entry_is_rebuilt(tmp_path: Path) -> None:
    cache, log = tmp_path / "cache", tmp_path / "builds.log"
    killed = start_builder(cache, log, 600.0)
    while builds(log) == 0:  # it holds the lock and has begun writing
        assert killed.poll() is None, "the builder ended before it began"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    survivor = start_builder(cache, log, 0.0)
    folder = survivor.communicate()[0].strip()
    assert survivor.returncode == 0 and builds(log) == 2
    assert (Path(folder) / COMPLETE).exists()
