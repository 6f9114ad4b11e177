"""Per-step cost of choosing a global batch's rows (`nox -s bench_order`): the keyed bijection
`raytrain_common.tokens.order` evaluates per position, against drawing the pass's whole permutation (the
order before raytrain-common 0.13), at 10^5, 10^7 and 10^9 rows, in this one process.

Printed per size: milliseconds per step and the peak memory the step allocates (tracemalloc sees
numpy's buffers), for both, and their ratios. The drawn permutation at 10^9 rows needs 8 GB and
about a minute; it runs only with --baseline-at-billion. Then the other half of a step's data cost
in llm_fsdp: reading one rank's micro-batch of rows (16 × 2,049 uint16 tokens) by `os.preadv` at
those rows' offsets in a 1 GiB file, as `raytrain_common.tokens.file.TokenBlocks.take` does (page cache warm:
the file was just written).

    python -m benchmarks.llm_fsdp.bench_order [--global-batch 512] [--steps 200] [--baseline-at-billion]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from raytrain_common.tokens.order import global_batch_indices

SIZES = (10**5, 10**7, 10**9)


def drawn_permutation_step(step: int, global_batch: int, rows: int, seed: int) -> np.ndarray:
    """The previous order: the pass's permutation drawn whole, then sliced."""
    start = step * global_batch % rows
    order = np.random.default_rng([seed, step * global_batch // rows]).permutation(rows)
    return order[start : start + global_batch]


def measure(
    choose: Callable[[int, int, int, int], np.ndarray], rows: int, global_batch: int, steps: int
) -> tuple[float, float]:
    """(ms per step, peak MiB allocated by one step) over `steps` consecutive steps."""
    choose(steps, global_batch, min(rows, 1000), 1)  # numpy's first-use costs, outside the timing
    tracemalloc.start()
    try:
        started = time.perf_counter()
        for step in range(steps):
            choose(step, global_batch, rows, 0)
        per_step_ms = (time.perf_counter() - started) / steps * 1e3
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return per_step_ms, peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200, help="steps timed per size (bijection)")
    parser.add_argument("--baseline-at-billion", action="store_true")
    args = parser.parse_args()
    print(f"global batch {args.global_batch}; ms per step and peak MiB per step")
    print("| rows | bijection ms | bijection MiB | drawn permutation ms | drawn MiB | ms ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in SIZES:
        ms, mib = measure(global_batch_indices, rows, args.global_batch, args.steps)
        if rows < 10**9 or args.baseline_at_billion:
            base_steps = 20 if rows <= 10**5 else 2 if rows <= 10**7 else 1
            base_ms, base_mib = measure(drawn_permutation_step, rows, args.global_batch, base_steps)
            drawn = f"{base_ms:.1f} | {base_mib:.0f} | {base_ms / ms:.2g}×"
        else:
            drawn = "not run (8 GB) | 7629 | –"
        print(f"| {rows:.0e} | {ms:.2f} | {mib:.2f} | {drawn} |")
    print(
        f"\nreading a rank's 16 rows of 2,049 uint16 tokens from a 1 GiB file: "
        f"{measure_reads():.2f} ms (rows chosen as above, one preadv per row)"
    )


def measure_reads(rows_per_read: int = 16, row_bytes: int = 2049 * 2, reads: int = 200) -> float:
    """ms to read `rows_per_read` rows at random offsets of a 1 GiB file, one preadv each."""
    import os
    import tempfile

    file_rows = (1 << 30) // row_bytes
    with tempfile.NamedTemporaryFile(prefix="bench-order-") as file:
        chunk = np.random.default_rng(0).integers(0, 256, size=64 << 20, dtype=np.uint8).tobytes()
        for _ in range(16):
            file.write(chunk)
        file.flush()
        out = np.empty((rows_per_read, row_bytes), dtype=np.uint8)
        started = time.perf_counter()
        for step in range(reads):
            for position, row in enumerate(global_batch_indices(step, rows_per_read, file_rows, 0)):
                os.preadv(file.fileno(), [out[position]], int(row) * row_bytes)
        return (time.perf_counter() - started) / reads * 1e3


if __name__ == "__main__":
    main()
