"""Data written in label order (a CSV sorted by date or class): over an epoch each of 2 workers
trains on a sample of the whole split, in another order every epoch and the same order when the
epoch is read again (a resume relies on it)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler
from transformers.trainer_pt_utils import get_length_grouped_indices

from hf_finetune.validator import eval_batch_per_worker
from raytrain_common.labelled.tokenized import (
    TokenizedSplit,
    label_length_rows,
    length_grouped_order,
    token_rows,
)

BATCH, WORKERS = 16, 2
# A worker's ~1,200 rows give a standard error of ~0.014 on a label's share; 0.07 is 5 of them,
# while a worker fed a contiguous half of a label-sorted split would be off by 0.4.
MAX_SHARE_GAP = 0.07


class ArrayRows:
    """Rows in memory, read like a RowFile."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def take(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.array[np.asarray(indices, dtype=np.int64)]


def label_sorted_split(rows: int = 2400) -> TokenizedSplit:
    rng = np.random.default_rng(0)
    labels = np.sort(rng.choice(3, size=rows, p=[0.5, 0.3, 0.2]))
    lengths = rng.integers(4, 64, size=rows)
    table = pa.table(
        {
            "input_ids": [[101] * int(n) for n in lengths],
            "label": labels,
            "length": lengths,
        }
    )
    return split_from_table(table, max_length=64)


def split_from_table(table: pa.Table, max_length: int) -> TokenizedSplit:
    """A split already in memory, read the way training reads a prepared one."""
    batch = pa.RecordBatch.from_arrays(
        [table.column(name).combine_chunks() for name in ("input_ids", "label", "length")],
        names=["input_ids", "label", "length"],
    )
    both = label_length_rows(batch, max_length)
    rows = ArrayRows(token_rows(batch, max_length))
    return TokenizedSplit(rows, both[:, 0].astype(np.int64), both[:, 1].astype(np.int64))


def labels_of_worker(split: TokenizedSplit, epoch: int, rank: int) -> np.ndarray:
    """The rows rank `rank` trains on in `epoch`: the split's own order, read in sequence, batched
    and sharded over the workers as the Trainer's accelerate DataLoader does it."""
    split = split.shuffled(seed=0, group_batch=BATCH)
    split.set_epoch(epoch)
    assert split.order is not None
    shard = BatchSamplerShard(
        BatchSampler(range(len(split)), BATCH, drop_last=False),
        num_processes=WORKERS,
        process_index=rank,
    )
    return np.concatenate([split.labels[split.order[batch]] for batch in shard])


def test_each_worker_trains_on_the_whole_label_sorted_split_in_a_fresh_order_every_epoch() -> None:
    split = label_sorted_split()
    whole = np.bincount(split.labels, minlength=3) / len(split)
    first = {rank: labels_of_worker(split, 0, rank) for rank in range(WORKERS)}
    for rank, labels in first.items():
        share = np.bincount(labels, minlength=3) / len(labels)
        assert np.abs(share - whole).max() < MAX_SHARE_GAP, (rank, share)
        assert len(labels) >= len(split) // WORKERS
        assert len(np.unique(labels[: len(labels) // 10])) == 3  # mixed from the start
    assert not np.array_equal(labels_of_worker(split, 1, 0), first[0])
    assert np.array_equal(labels_of_worker(split, 0, 0), first[0])


def test_the_length_grouped_order_is_transformers_own_in_numpy() -> None:
    """The numpy order (8 bytes a row) is exactly transformers' own `get_length_grouped_indices`
    (Python lists, ~40 bytes a row) from the same generator: ties, a last short mega-batch and
    tiny splits included."""
    rng = np.random.default_rng(3)
    for rows, batch in ((2400, 16), (1000, 7), (5, 4), (1, 8)):
        lengths = rng.integers(4, 12, size=rows)  # few distinct lengths: many ties
        for seed in (0, 3):
            ours = length_grouped_order(lengths, batch, torch.Generator().manual_seed(seed))
            theirs = get_length_grouped_indices(
                lengths, batch, generator=torch.Generator().manual_seed(seed)
            )
            assert ours.tolist() == theirs, (rows, batch, seed)


def evaluated_rows(rows: int, batch: int) -> list[list[int]]:
    """The rows each worker evaluates, as the Trainer's accelerate DataLoader shards them."""
    return [
        [
            row
            for rows_of_batch in BatchSamplerShard(
                BatchSampler(range(rows), batch, drop_last=False),
                num_processes=WORKERS,
                process_index=rank,
            )
            for row in rows_of_batch
        ]
        for rank in range(WORKERS)
    ]


def test_evaluation_covers_the_split_once_with_the_fewest_filler_rows() -> None:
    """Accelerate fills each worker's last evaluation batch to full size: 64 rows at 128 a batch
    were 256 rows of work. The evened-out batch takes as many batches and at most one filler row
    per batch per worker."""
    assert sum(map(len, evaluated_rows(64, 128))) == 256
    for rows in (1, 5, 64, 383, 384, 2370, 18963):
        size = eval_batch_per_worker(rows, WORKERS, most=128)
        assert 1 <= size <= 128
        per_worker = evaluated_rows(rows, size)
        assert set(per_worker[0]) | set(per_worker[1]) == set(range(rows))
        batches = len(per_worker[0]) // size
        assert batches == max(1, -(-rows // (WORKERS * 128)))  # no extra evaluation step
        assert sum(map(len, per_worker)) - rows < WORKERS * batches, rows
