"""The order a training split is read in: a fresh, seeded, global permutation of its rows every pass,
consumed in global batches that every worker count cuts the same way.

Why not Ray Data's order: `randomize_block_order` permutes blocks, not rows, and a streaming split
that preserves order hands each worker the same contiguous rows every epoch, so a split written in
class order (an image tree read folder by folder, a CSV sorted by date) trains each worker on a fixed
part of it. Here the rows of optimiser step `s` in pass `p` are positions [s·G, (s+1)·G) of the
permutation drawn from (seed, p), whatever order the rows were written in; rank `r` takes its
micro-batches of that global batch. The order is a pure function of (seed, pass, step), so a run
resumed mid-epoch, on the same or another worker count, continues with exactly the rows not yet seen.
"""

from __future__ import annotations

import numpy as np


def pass_permutation(num_rows: int, seed: int, pass_index: int) -> np.ndarray:
    """Every row index once, in the order of pass `pass_index` (0-based) of the run seeded `seed`."""
    return np.random.default_rng([seed, pass_index]).permutation(num_rows)


def global_batch_indices(step: int, global_batch_size: int, num_rows: int, seed: int) -> np.ndarray:
    """The rows of optimiser step `step` of an endless stream of passes (a step may span two): for
    step-counted runs, where a pass is not an epoch boundary the loop cares about."""
    positions = np.arange(step * global_batch_size, (step + 1) * global_batch_size)
    passes, offsets = np.divmod(positions, num_rows)
    out = np.empty_like(positions)
    for one_pass in np.unique(passes):
        chosen = passes == one_pass
        out[chosen] = pass_permutation(num_rows, seed, int(one_pass))[offsets[chosen]]
    return out


def epoch_batch_indices(order: np.ndarray, step: int, global_batch_size: int) -> np.ndarray:
    """The rows of step `step` (0-based, within the epoch) of an epoch read in `order`; the rows
    after the last full global batch wait for another epoch's order to reach them."""
    return order[step * global_batch_size : (step + 1) * global_batch_size]


def micro_batches(indices: np.ndarray, rank: int, world: int, accum: int) -> list[np.ndarray]:
    """This rank's micro-batches of a global batch: rank-major within each accumulation step, so
    the global batch is the same rows on every worker count."""
    per_micro = len(indices) // (world * accum)
    return [
        indices[(a * world + rank) * per_micro : (a * world + rank + 1) * per_micro]
        for a in range(accum)
    ]
