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

import os
import time

# The probe's seconds on the reference box, idle (the fastest of 10: 2026-12-06, the 2-core box at
# ~480-600 images/s, where idle runs read 0.10-0.21 s and runs beside two busy loops 0.24-0.31 s).
REFERENCE_PROBE_S = 0.10
REMEASURE_S = 30.0

_measured: tuple[float, float] | None = None  # (when, factor)


def probe_s() -> float:
    """Seconds of a fixed interpreter workload, long enough (~0.1 s on the reference box) for the
    scheduler's sharing of a busy box's cores to show in it."""
    started = time.perf_counter()
    total = 0
    for value in range(2_000_000):
        total += value * value % 7
    return time.perf_counter() - started


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
