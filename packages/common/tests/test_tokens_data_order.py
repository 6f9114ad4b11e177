"""A corpus packed in source order (works sorted by title, documents by date): over one pass each of
2 workers trains on blocks from the whole corpus, another order every pass, and the global batches
do not depend on the worker count (resume and elastic resizes stay exact)."""

from __future__ import annotations

import numpy as np

from raytrain_common.tokens.order import global_batch_indices, micro_batches

BLOCKS, GLOBAL_BATCH, SOURCES = 4000, 16, 8
# A worker's 2,000 blocks give a standard error of ~0.0074 on a source's share (1/8); 0.04 is over
# 5 of them, while a worker fed a contiguous half of the corpus would be off by 0.125.
MAX_SHARE_GAP = 0.04


def blocks_of_worker(rank: int, world: int, steps: range) -> np.ndarray:
    """The blocks rank `rank` trains on over `steps`, cut as train_loop_per_worker cuts them."""
    return np.concatenate(
        [
            part
            for step in steps
            for part in micro_batches(
                global_batch_indices(step, GLOBAL_BATCH, BLOCKS, seed=0), rank, world, accum=1
            )
        ]
    )


def test_each_worker_trains_on_the_whole_corpus_in_a_fresh_order_every_pass() -> None:
    one_pass = range(BLOCKS // GLOBAL_BATCH)
    source_of = np.arange(BLOCKS) * SOURCES // BLOCKS  # blocks packed source after source
    seen = {rank: blocks_of_worker(rank, 2, one_pass) for rank in (0, 1)}
    for rank, blocks in seen.items():
        share = np.bincount(source_of[blocks], minlength=SOURCES) / len(blocks)
        assert np.abs(share - 1 / SOURCES).max() < MAX_SHARE_GAP, (rank, share)
        assert len(np.unique(source_of[blocks[:100]])) == SOURCES  # mixed from the start
    together = np.concatenate(list(seen.values()))
    assert sorted(together.tolist()) == list(range(BLOCKS))  # one pass: every block once
    second_pass = range(len(one_pass), 2 * len(one_pass))
    assert not np.array_equal(blocks_of_worker(0, 2, second_pass), seen[0])
    # The same step's global batch on 1 worker and on 2 (the order depends on the step alone).
    for step in (0, 7, 300):
        on_one = blocks_of_worker(0, 1, range(step, step + 1))
        on_two = np.concatenate([blocks_of_worker(r, 2, range(step, step + 1)) for r in (0, 1)])
        assert np.array_equal(on_one, on_two)
