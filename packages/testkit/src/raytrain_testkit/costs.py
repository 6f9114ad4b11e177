"""What each test costs in CPU-seconds, so that the test that would push a slow box past CI's 90
minutes is seen in the run that adds it (`.ci/run` prints the ten most expensive at its end:
tools/test_costs.py).

A test's CPU is that of the pytest process and every process it starts, directly or not (the Ray
clusters, their workers, the commands it runs), counted by the kernel: each pytest process puts
itself in a cgroup of its own under cgroup v1's cpuacct (root, as CI runs), which every process
it starts inherits, daemons and processes already ended included, and a test's figure is the
group's `cpuacct.usage` over the test. Podman's containers run in cgroups of their own and are not
counted. Without a writable cpuacct hierarchy the figure falls back to the live process tree
(`tree_cpu_seconds`), which misses processes that ended unreaped or left the tree (Ray's workers
among them): a floor, said so in the table.
"""

from __future__ import annotations

import contextlib
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


CPUACCT = Path("/sys/fs/cgroup/cpuacct")
GROUP_PREFIX = "raytrain-test-"


class CpuMeter:
    """CPU-seconds of this process and everything it starts, since some point: the kernel's count
    for a cgroup of this process's own where it can make one, else the live process tree."""

    def __init__(self) -> None:
        self.group: Path | None = None
        self.clear_stale_groups()
        group = CPUACCT / f"{GROUP_PREFIX}{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:  # no cgroup v1 cpuacct here, or not root
            return
        self.group = group

    @property
    def kind(self) -> str:
        return "cgroup" if self.group else "process tree (a floor)"

    def seconds(self) -> float:
        if self.group is not None:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        return tree_cpu_seconds()

    def close(self) -> None:
        """Back to the root group; this one is removed once nothing runs in it."""
        if self.group is None:
            return
        with contextlib.suppress(OSError):
            (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
            self.group.rmdir()
        self.group = None

    @staticmethod
    def clear_stale_groups() -> None:
        """Groups left by pytest processes that ended before they could remove theirs."""
        for group in CPUACCT.glob(f"{GROUP_PREFIX}*"):
            with contextlib.suppress(OSError, ValueError):
                if not Path(f"/proc/{int(group.name.removeprefix(GROUP_PREFIX))}").exists():
                    group.rmdir()  # refused while a process of it still runs


def record_cost(
    folder: Path, test: str, meter: CpuMeter, started_cpu: float, started_wall: float
) -> None:
    """Appends one JSON line (the test's id, wall seconds, CPU-seconds since the given start, how
    they were counted) to this process's file in `folder` (one file per pytest process: two never
    interleave a line)."""
    record = {
        "test": test,
        "wall_s": round(time.monotonic() - started_wall, 2),
        "cpu_s": round(meter.seconds() - started_cpu, 2),
        "counted_by": meter.kind,
    }
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{os.getpid()}.jsonl", "a") as stream:
        stream.write(json.dumps(record) + "\n")
