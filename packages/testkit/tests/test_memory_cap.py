"""The memory cap the memory tests rely on binds: a process over it is killed by the kernel, one
under it is not, and page cache over it is reclaimed instead (cgroup v1, root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_testkit.memory_cap import MemoryCap, unavailable
from raytrain_testkit.pace import paced

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")

HOLD = "import sys, time; block = bytearray(int(sys.argv[1]) << 20); time.sleep(0.2)"


def run_inside(cap: MemoryCap, *args: str) -> int:
    process = subprocess.Popen([sys.executable, "-c", *args], stdin=subprocess.PIPE)
    cap.adopt(process.pid)
    process.stdin.close()  # type: ignore[union-attr]
    return process.wait(timeout=paced(60))


def test_a_process_over_the_cap_is_killed_and_one_under_it_is_not(tmp_path: Path) -> None:
    cap = MemoryCap(limit_mb=200)
    try:
        # The child reads its stdin before it allocates, so it joins the cap first.
        wait_then = "import sys; sys.stdin.read(); "
        assert run_inside(cap, wait_then + HOLD, "100") == 0
        assert cap.oom_kills == 0
        assert run_inside(cap, wait_then + HOLD, "400") == -9  # SIGKILL from the OOM killer
        assert cap.oom_kills == 1
        # 400 MiB of file pages read through the page cache under the 200 MiB cap (dropped from
        # the cache first, so this group is charged for them): reclaimed as it goes, no kill.
        # Written back to disk first: the kernel drops only clean pages on POSIX_FADV_DONTNEED,
        # and dirty ones left in the cache would be read without charging this group.
        big = tmp_path / "big"
        with big.open("wb") as out:
            out.write(b"\0" * (400 << 20))
            out.flush()
            os.fsync(out.fileno())
        read = (
            "import os, sys; sys.stdin.read(); fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)\n"
            "while os.read(fd, 1 << 20): pass"
        )
        cap.reset_peak()
        assert run_inside(cap, read, str(big)) == 0
        assert cap.oom_kills == 1
        assert cap.peak_mb > 150  # the cache filled the group up to its cap
    finally:
        cap.close()
