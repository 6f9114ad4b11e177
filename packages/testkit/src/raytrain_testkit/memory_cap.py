"""A memory limit on the processes of one Ray node, as a container's limit is: a cgroup (v1 memory
controller) that the node's raylet joins, so every worker it starts afterwards is inside it too.

What the memory tests use to prove that a pipeline's workers hold memory that does not grow with
the data: a run on a capped node either stays under the cap or has a worker killed by the kernel's
OOM killer (`oom_kills`), exactly as a Kubernetes pod over its limit does. Page cache counts
against the cap but is reclaimed under it, so memory-mapped row files fit in a cap smaller than
themselves, and a split read into anonymous memory does not.

Needs a writable cgroup v1 memory hierarchy (`/sys/fs/cgroup/memory`, root in a container);
`unavailable()` says why not where there is none.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
NO_CAP_MB = 16 << 10  # a limit above anything a test node holds: the group only measures


@dataclass
class Held:
    """What `MemoryCap.sampling_held` saw: the group's samples (MiB that the kernel cannot
    reclaim), and the most each process held, so a kill can be traced to the one that grew."""

    samples: list[float] = field(default_factory=list)
    processes: dict[str, float] = field(default_factory=dict)  # "pid command" → MiB

    @property
    def peak_mb(self) -> float:
        return max(self.samples, default=0.0)

    def note_process(self, pid: str) -> None:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended meanwhile
            return
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        kib = sum(int(fields.get(name, "0 kB").split()[0]) for name in ("RssAnon", "RssShmem"))
        key = f"{pid} {command.strip()[:50]}"
        self.processes[key] = max(self.processes.get(key, 0.0), kib / 1024)

    def largest(self, count: int = 4) -> str:
        ranked = sorted(self.processes.items(), key=lambda item: -item[1])[:count]
        return "; ".join(f"{mb:.0f} MiB {key}" for key, mb in ranked)


def unavailable() -> str | None:
    """None where caps can be set here; otherwise why not, in one line."""
    if not (MEMORY_ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {MEMORY_ROOT}"
    if not os.access(MEMORY_ROOT, os.W_OK):
        return f"{MEMORY_ROOT} is not writable by this user (root in a container is needed)"
    return None


class MemoryCap:
    """A new cgroup limited to `limit_mb` MiB of memory (no swap on these boxes; where there is
    swap, memsw is capped too), removed again by `close`."""

    def __init__(self, limit_mb: int) -> None:
        reason = unavailable()
        if reason:
            raise RuntimeError(f"cannot cap memory: {reason}")
        self.path = MEMORY_ROOT / f"raytrain-cap-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        self.limit_mb = 0
        self.set_limit(limit_mb)

    def set_limit(self, limit_mb: int) -> None:
        """Cap the group at `limit_mb` MiB (lowering it reclaims page cache first). Where swap is
        accounted, memory + swap gets the same cap, so a capped process cannot swap instead."""
        memsw = self.path / "memory.memsw.limit_in_bytes"
        current = int((self.path / "memory.limit_in_bytes").read_text())
        # The kernel keeps memsw >= memory: raise memsw first, lower it last.
        raising = (limit_mb << 20) > current
        if memsw.exists() and raising:
            self._write(memsw.name, limit_mb << 20)
        self._write("memory.limit_in_bytes", limit_mb << 20)
        if memsw.exists() and not raising:
            self._write(memsw.name, limit_mb << 20)
        self.limit_mb = limit_mb

    def reset_peak(self) -> None:
        self._write("memory.max_usage_in_bytes", 0)

    def _write(self, name: str, value: int | str) -> None:
        (self.path / name).write_text(f"{value}\n")

    def adopt(self, pid: int) -> None:
        """Move `pid` and everything it has started into the cap; what it starts later follows.
        Memory a process held before it joined stays charged where it was (kernels since 6.x no
        longer move charges): adopt a node's processes before its workers start."""
        import psutil

        process = psutil.Process(pid)
        for member in [process, *process.children(recursive=True)]:
            try:
                self._write("cgroup.procs", member.pid)
            except (OSError, ProcessLookupError):  # ended meanwhile
                continue

    @property
    def peak_mb(self) -> float:
        """The most memory the capped processes held together, page cache included."""
        return int((self.path / "memory.max_usage_in_bytes").read_text()) / 2**20

    @property
    def held_mb(self) -> float:
        """What the group holds now that the kernel cannot reclaim: anonymous memory and shared
        memory (Ray's object store), not page cache."""
        stat = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        return (int(stat["total_rss"]) + int(stat["total_shmem"])) / 2**20

    @contextlib.contextmanager
    def sampling_held(self, every_s: float = 0.2) -> Iterator[Held]:
        """Samples `held_mb`, and what each capped process holds, in a thread while the block
        runs."""
        held = Held()
        done = threading.Event()

        def sample() -> None:
            while not done.wait(every_s):
                held.samples.append(self.held_mb)
                for pid in (self.path / "cgroup.procs").read_text().split():
                    held.note_process(pid)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield held
        finally:
            done.set()
            thread.join()

    @property
    def oom_kills(self) -> int:
        """Processes the kernel killed for going over the cap (0 where the kernel does not say)."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def close(self) -> None:
        """Move whatever is left back to the root group and remove the cgroup."""
        if not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (MEMORY_ROOT / "cgroup.procs").write_text(f"{pid}\n")
            except OSError:
                continue
        # A process in it that is still exiting keeps it; the kernel frees it with the last one.
        with contextlib.suppress(OSError):
            self.path.rmdir()


@dataclass(frozen=True)
class CappedRun:
    """A run under a cap calibrated on a baseline run (`train_capped_after_baseline`)."""

    baseline: Held
    capped: Held
    limit_mb: int
    oom_kills: int
    exit_code: int
    log: str

    def report(self, what: str) -> str:
        """One paragraph of the figures, `what` naming the data."""
        return (
            f"baseline {self.baseline.peak_mb:.0f} MiB held (anonymous and shared memory), "
            f"{what}, cap {self.limit_mb} MiB, the capped run held at most "
            f"{self.capped.peak_mb:.0f} MiB, OOM kills {self.oom_kills}; the largest processes "
            f"of the baseline run: {self.baseline.largest()}; of the capped run: "
            f"{self.capped.largest()}"
        )
