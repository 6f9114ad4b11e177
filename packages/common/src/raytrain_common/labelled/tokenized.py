"""A pre-tokenised split as a map-style dataset the Trainer samples, shards and skips through.

The token ids are read by row index from a node-local row file built once from the Parquet
(raytrain_common.rowfile), so a worker holds the rows of its batches, not the split: in memory stay
the labels and lengths (8 bytes a row) and the epoch's order (8 more).

A training split orders itself: item i of epoch e is row `order[i]`, where the order is drawn from
(seed, e) alone. Accelerate's DataLoader calls the dataset's `set_epoch(e)` before every epoch, a
resumed one included, so the Trainer's sequential sampler walks a fresh permutation every epoch
and a resumed epoch skips exactly the batches the interrupted run had trained (the stock samplers
draw from the global RNG when an epoch starts, which a resume has restored to another point).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from raytrain_common.labelled.prepare import split_dir as prepared_split_dir
from raytrain_common.rowfile import RowSource, row_file
from raytrain_common.storage import StoragePath

MEGABATCH_BATCHES = 50  # transformers' length grouping: mega-batches of up to 50 batches


class TokenizedSplit(torch.utils.data.Dataset):
    """Rows of a pre-tokenised split; `DataCollatorWithPadding` pads each batch to its longest row.

    `shuffle_seed` None: rows in file order (evaluation). Otherwise each epoch's order is a seeded
    permutation, grouped by length within mega-batches when `group_batch` is set (less padding).
    """

    def __init__(
        self,
        ids: RowSource,
        labels: np.ndarray,
        lengths: np.ndarray,
        rows: np.ndarray | None = None,
    ) -> None:
        self.ids = ids  # (rows, 1 + max_length) int32: the kept length, then the ids, zero-padded
        self.labels = labels
        self.lengths = lengths  # untruncated lengths capped at the truncation
        self.rows = rows  # item i is row rows[i] of the row file (None: row i)
        self.shuffle_seed: int | None = None
        self.group_batch = 0
        self.order: np.ndarray | None = None

    @classmethod
    def open(
        cls, data_dir: StoragePath, split: str, max_length: int, limit: int | None
    ) -> TokenizedSplit:
        """The split's first `limit` rows of its seeded order (row ids below `limit`: a random
        sample whatever order the files hold), all if None, read through this node's row files."""
        split_dir = prepared_split_dir(data_dir, split)
        layout = f"ids{max_length}-i32-v1"
        ids = row_file(
            split_dir,
            "input_ids",
            ["input_ids"],
            functools.partial(token_rows, max_length=max_length),
            layout,
        )
        labelled = row_file(
            split_dir,
            "label_length_row",
            ["label", "length", "row"],
            functools.partial(label_length_rows, max_length=max_length),
            f"{layout}-row-i32",
        )
        # Read a chunk at a time; what stays is 8 bytes a row (int32 label and length).
        labels, lengths = [np.zeros(0, np.int32)], [np.zeros(0, np.int32)]
        kept, start = [np.zeros(0, np.int64)], 0
        for chunk in labelled.read_all():
            rows_read = len(chunk)
            if limit is not None:
                chosen = np.flatnonzero(chunk[:, 2] < limit)
                kept.append(chosen + start)
                chunk = chunk[chosen]
            labels.append(chunk[:, 0])
            lengths.append(chunk[:, 1])
            start += rows_read
        rows = None if limit is None else np.concatenate(kept)
        return cls(ids, np.concatenate(labels), np.concatenate(lengths), rows)

    def shuffled(self, seed: int, group_batch: int = 0) -> TokenizedSplit:
        """This split, drawn in a new order every epoch from (seed, epoch); length-grouped for
        batches of `group_batch` rows (per device × accumulation steps) when it is not 0."""
        self.shuffle_seed, self.group_batch = seed, group_batch
        self.set_epoch(0)
        return self

    def set_epoch(self, epoch: int) -> None:
        """Called by accelerate's DataLoader before each epoch (a resumed one too)."""
        if self.shuffle_seed is None:
            return
        generator = torch.Generator().manual_seed(self.shuffle_seed * 100_003 + epoch)
        if self.group_batch:
            self.order = length_grouped_order(self.lengths, self.group_batch, generator)
        else:
            self.order = torch.randperm(len(self.labels), generator=generator).numpy()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = index if self.order is None else int(self.order[index])
        row = self.token_rows(np.array([item]))[0]
        return {"input_ids": row[1 : 1 + row[0]].tolist(), "labels": int(self.labels[item])}

    def token_rows(self, items: np.ndarray) -> np.ndarray:
        """The token rows of items (positions in `labels` and `lengths`): under a limit, the
        kept rows' places in the row file, not the items themselves."""
        return self.ids.take(items if self.rows is None else self.rows[items])


def length_grouped_order(
    lengths: np.ndarray, batch_size: int, generator: torch.Generator
) -> np.ndarray:
    """Transformers' length-grouped order (`get_length_grouped_indices`: a permutation cut into
    mega-batches of up to 50 batches, each sorted longest first, the longest row's mega-batch
    swapped to the front), computed in numpy: 8 bytes a row, where its Python lists take ~40."""
    lengths = np.asarray(lengths)
    rows = len(lengths)
    megabatch = max(min(rows // (batch_size * 4), MEGABATCH_BATCHES), 1) * batch_size
    order = torch.randperm(rows, generator=generator).numpy()
    for start in range(0, rows, megabatch):
        part = order[start : start + megabatch]
        # Stable, as Python's sorted(reverse=True) is: equal lengths keep the drawn order.
        order[start : start + megabatch] = part[np.argsort(-lengths[part], kind="stable")]
    if rows:
        longest = int(np.argmax(lengths[order[::megabatch]])) * megabatch
        order[[0, longest]] = order[[longest, 0]]
    return order


def token_rows(batch: pa.RecordBatch, max_length: int) -> np.ndarray:
    """A batch's token ids as fixed-size rows: the kept length (≤ max_length), then the ids."""
    ids = batch.column(batch.schema.get_field_index("input_ids"))
    offsets = ids.offsets.to_numpy()
    values = ids.values.to_numpy(zero_copy_only=False)
    rows = np.zeros((len(ids), 1 + max_length), dtype=np.int32)
    kept = np.minimum(np.diff(offsets), max_length)
    rows[:, 0] = kept
    for row, (start, length) in enumerate(zip(offsets[:-1], kept, strict=True)):
        rows[row, 1 : 1 + length] = values[start : start + length]
    return rows


def label_length_rows(batch: pa.RecordBatch, max_length: int) -> np.ndarray:
    """(label, length capped at max_length, row id) of each row; row id 0.. when there is none."""
    labels = batch.column(batch.schema.get_field_index("label")).to_numpy()
    lengths = batch.column(batch.schema.get_field_index("length")).to_numpy()
    index = batch.schema.get_field_index("row")
    rows = batch.column(index).to_numpy() if index >= 0 else np.arange(len(labels))
    return np.stack([labels, np.minimum(lengths, max_length), rows], axis=1).astype(np.int32)
