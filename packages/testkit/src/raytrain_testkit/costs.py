"""What each test costs in CPU-seconds, so that the test that would push a slow box past CI's 90
minutes is seen in the run that adds it (`.ci/run` prints the ten most expensive at its end:
tools/test_costs.py).

A test's CPU is that of the pytest process and every process below it (the Ray clusters it
starts, their workers, the commands it runs), read from /proc at the test's start and end:
utime + stime + the children's times a process has reaped (cutime + cstime), summed over the tree
each time. A process that ended during the test is counted through the parent that reaped it, so
nothing is counted twice. Not counted: processes that left the tree (a daemon whose parent exited,
as `ray start`'s and podman's are), so a figure is a floor for tests that start those.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def process_table() -> dict[int, tuple[int, float]]:
    """pid → (parent pid, CPU-seconds of it and its reaped children) for every process."""
    table: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stream:
                stat = stream.read().decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        fields = stat[
            stat.rindex(")") + 2 :
        ].split()  # after the command name, which may hold spaces
        parent = int(fields[1])
        utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
        table[int(entry.name)] = (parent, (utime + stime + cutime + cstime) / TICKS)
    return table


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU-seconds of `root` (this process) and every live process below it, each with the times
    of the children it reaped."""
    root = root or os.getpid()
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            total += table[pid][1]
            stack.extend(children.get(pid, []))
    return total


def record_cost(folder: Path, test: str, started_cpu: float, started_wall: float) -> None:
    """Appends one JSON line (the test's id, wall seconds, CPU-seconds since the given start) to
    this process's file in `folder` (one file per pytest process: two never interleave a line)."""
    record = {
        "test": test,
        "wall_s": round(time.monotonic() - started_wall, 2),
        "cpu_s": round(tree_cpu_seconds() - started_cpu, 2),
    }
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{os.getpid()}.jsonl", "a") as stream:
        stream.write(json.dumps(record) + "\n")
