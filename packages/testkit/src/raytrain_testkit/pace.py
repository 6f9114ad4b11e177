"""Deadlines that follow the box's pace: `paced(300)` is 300 s on the reference box (the 2-core
box at ~500 images/s by `box_speed`, idle) and proportionally more on a slower or busier one.

A test's wait (a server ready, a step reached, a trial finished, a command done) is written
`paced(seconds on the reference box)`, never a bare number: CI's boxes of the same kind differ
2-5× in speed, and two pytest processes share one. tests/test_repo.py flags a bare deadline.

The pace is measured, not guessed: a fixed pure-Python workload (interpreter work, as the process
starts and imports that dominate these waits are) timed now, against its time on the reference
box; re-measured at most every 30 s, so a wait computed while the box is loaded is longer. Never
below 1: a fast box keeps the reference's margins. `RAYTRAIN_TEST_PACE=F` sets the factor instead
(for a box known to be slow in ways the probe does not see, such as a throttled disk).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

# The probe's seconds on the reference box, idle (the fastest of 10: 2026-12-06, the 2-core box at
# ~480-600 images/s, where idle runs read 0.10-0.21 s; beside two busy loops at Ray's worker
# niceness 0.23 s, beside two at nice 0 3.4 s: Ray's workers starve there, and the pace says so).
REFERENCE_PROBE_S = 0.10
REMEASURE_S = 30.0

_measured: tuple[float, float] | None = None  # (when, factor)


# Ray starts its worker processes at nice 15 (`ps -o ni`: the raylet and GCS stay at 0): beside
# busy processes at nice 0 a worker gets ~1/28 of a core's share, not 1/2. The probe runs at the
# workers' niceness, so the pace is the one the runs it times see.
RAY_WORKER_NICENESS = 15


def probe_s() -> float:
    """Seconds of a fixed interpreter workload, long enough (~0.1 s on the reference box) for the
    scheduler's sharing of a busy box's cores to show in it, run in a thread at Ray's worker
    niceness (Linux sets a niceness per thread; the caller's own is untouched)."""
    timed: list[float] = []

    def workload() -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: the caller's niceness
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), RAY_WORKER_NICENESS)
        started = time.perf_counter()
        total = 0
        for value in range(2_000_000):
            total += value * value % 7
        timed.append(time.perf_counter() - started)

    thread = threading.Thread(target=workload, name="pace-probe")
    thread.start()
    thread.join()
    return timed[0]


def pace() -> float:
    """How many times slower than the reference this box runs now (≥ 1)."""
    global _measured
    forced = os.environ.get("RAYTRAIN_TEST_PACE")
    if forced:
        return max(1.0, float(forced))
    now = time.monotonic()
    if _measured is None or now - _measured[0] > REMEASURE_S:
        _measured = (now, max(1.0, probe_s() / REFERENCE_PROBE_S))
    return _measured[1]


def paced(seconds: float) -> float:
    """`seconds` on the reference box, as long as this box needs now."""
    return seconds * pace()
