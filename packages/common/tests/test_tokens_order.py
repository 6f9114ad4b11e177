"""The training order: every row exactly once per pass on a step stream that crosses passes, another
order every pass, the same rows for the same step whenever it is computed, and a step's cost in
memory independent of the split's size."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from raytrain_common.tokens.order import PassOrder, global_batch_indices

GLOBAL_BATCH = 64


@pytest.mark.parametrize("rows", [1, 2, 3, 63, 64, 65, 1000, 10_007])
def test_every_row_once_in_a_pass_whatever_the_row_count(rows: int) -> None:
    order = PassOrder(rows, seed=3, pass_index=0)[np.arange(rows)]
    assert np.array_equal(np.sort(order), np.arange(rows))


def test_a_step_stream_over_two_passes_trains_each_row_once_per_pass_in_a_new_order() -> None:
    rows = 10_007  # prime: steps straddle the pass boundary, and the domain needs cycle-walking
    steps = 2 * rows // GLOBAL_BATCH
    stream = np.concatenate(
        [global_batch_indices(s, GLOBAL_BATCH, rows, seed=7) for s in range(steps)]
    )
    first, second = stream[:rows], stream[rows : 2 * rows]
    assert np.array_equal(np.sort(first), np.arange(rows))
    assert len(np.unique(second)) == len(second)  # no row twice within the second pass either
    assert not np.array_equal(first[:1000], PassOrder(rows, 7, 1)[np.arange(1000)])
    assert np.array_equal(second, PassOrder(rows, 7, 1)[np.arange(len(second))])
    # Not the identity, nor a shift: the first pass's positions and rows are uncorrelated.
    assert abs(np.corrcoef(np.arange(rows), first)[0, 1]) < 0.05


def test_a_step_is_a_pure_function_of_seed_and_step() -> None:
    rows = 50_000
    again = global_batch_indices(123, GLOBAL_BATCH, rows, seed=1)
    assert np.array_equal(global_batch_indices(123, GLOBAL_BATCH, rows, seed=1), again)
    assert not np.array_equal(global_batch_indices(123, GLOBAL_BATCH, rows, seed=2), again)


def test_a_step_of_a_billion_row_split_allocates_kilobytes_not_the_split() -> None:
    tracemalloc.start()
    try:
        rows = global_batch_indices(10**7, 512, 10**9, seed=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(np.unique(rows)) == 512 and rows.min() >= 0 and rows.max() < 10**9
    assert peak < 1 << 20  # a drawn permutation would be 8 GB here
