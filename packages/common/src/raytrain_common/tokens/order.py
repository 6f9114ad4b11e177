"""The order a training split is read in: a fresh, seeded, global permutation of its rows every
pass, consumed in global batches that every worker count cuts the same way.

Why not Ray Data's order: `randomize_block_order` permutes blocks, not rows, and a streaming split
that preserves order hands each worker the same contiguous rows every epoch, so a split written in
class order (an image tree read folder by folder, a corpus sorted by date) trains each worker on a
fixed part of it. Here the rows of optimiser step `s` in pass `p` are positions [s·G, (s+1)·G) of
a permutation keyed by (seed, p), whatever order the rows were written in; rank `r` takes its
micro-batches of that global batch. The order is a pure function of (seed, pass, step), so a run
resumed mid-epoch, on the same or another worker count, continues with exactly the rows not yet
seen.

Why a bijection evaluated per position, not a drawn permutation: drawing the pass's permutation
(`numpy.random.Generator.permutation`) costs O(rows) time and 8 bytes a row on every rank — 3.9 GB
and tens of seconds per step at the ~488 M blocks of a 1 T-token corpus at sequence length 2,048.
`PassOrder` instead maps each position through a keyed Feistel network on the smallest power-of-4
domain that holds the rows, walking the cycle until it lands below `num_rows` (Black & Rogaway's
cycle-walking: a bijection on [0, num_rows) whatever that number is). A step costs
O(global batch × rounds × walk); the domain is below 4 × rows, so the expected walk is below 4.
Measured: `nox -s bench_order` (docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6  # Luby–Rackoff: 4 rounds of a good round function make a pseudo-random permutation

_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser constants
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _mix(values: np.ndarray) -> np.ndarray:
    """A 64-bit avalanche (splitmix64's finaliser): every output bit depends on every input bit.
    numpy's uint64 array products wrap around, which is the arithmetic the constants assume."""
    values = (values ^ (values >> np.uint64(30))) * _MIX_1
    values = (values ^ (values >> np.uint64(27))) * _MIX_2
    return values ^ (values >> np.uint64(31))


class PassOrder:
    """The permutation of [0, num_rows) for pass `pass_index` of the run seeded `seed`, evaluated
    one position at a time: `order[positions]` is the rows at those positions of the pass."""

    def __init__(self, num_rows: int, seed: int, pass_index: int) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows={num_rows}: a pass needs at least one row")
        self.num_rows = num_rows
        bits = max(2, int(num_rows - 1).bit_length())
        self.half_bits = np.uint64((bits + 1) // 2)  # a balanced network: 2 halves of equal width
        self.half_mask = np.uint64((1 << int(self.half_bits)) - 1)
        keys = np.random.default_rng([seed, pass_index]).integers(
            0, np.iinfo(np.uint64).max, size=ROUNDS, dtype=np.uint64, endpoint=True
        )
        self.keys = [np.uint64(key) for key in keys]

    def _permute_domain(self, values: np.ndarray) -> np.ndarray:
        left, right = values >> self.half_bits, values & self.half_mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.half_mask)
        return (left << self.half_bits) | right

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_rows):
            raise IndexError(f"positions outside [0, {self.num_rows})")
        values = self._permute_domain(positions.astype(np.uint64))
        outside = np.flatnonzero(values >= np.uint64(self.num_rows))
        while len(outside):  # cycle-walking: the next value on the cycle, until one is a row
            values[outside] = self._permute_domain(values[outside])
            outside = outside[values[outside] >= np.uint64(self.num_rows)]
        return values.astype(np.int64)


def global_batch_indices(step: int, global_batch_size: int, num_rows: int, seed: int) -> np.ndarray:
    """The rows of optimiser step `step` of an endless stream of passes (a step may span two): for
    step-counted runs, where a pass is not an epoch boundary the loop cares about."""
    positions = np.arange(step * global_batch_size, (step + 1) * global_batch_size, dtype=np.int64)
    passes, offsets = np.divmod(positions, num_rows)
    out = np.empty_like(positions)
    for one_pass in np.unique(passes):
        chosen = passes == one_pass
        out[chosen] = PassOrder(num_rows, seed, int(one_pass))[offsets[chosen]]
    return out


def micro_batches(indices: np.ndarray, rank: int, world: int, accum: int) -> list[np.ndarray]:
    """This rank's micro-batches of a global batch: rank-major within each accumulation step, so
    the global batch is the same rows on every worker count."""
    per_micro = len(indices) // (world * accum)
    return [
        indices[(a * world + rank) * per_micro : (a * world + rank + 1) * per_micro]
        for a in range(accum)
    ]
