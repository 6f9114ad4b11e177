"""Ray Data helpers a training loop needs: read Parquet from any storage, iterate a worker's shard."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ray.data
import ray.train.torch
from ray.data.collate_fn import ArrowBatchCollateFn

from raytrain_common.storage import StoragePath


def parquet_files(folder: StoragePath) -> list[StoragePath]:
    """The Parquet files of a dataset folder; an error that says how to make them if there are none."""
    files = folder.list_files(".parquet")
    if not files:
        raise FileNotFoundError(
            f"no Parquet files in {folder.uri!r}: run the pipeline's `prepare` command first, or "
            "point the data option at a folder of *.parquet files"
        )
    return files


def read_parquet(folder: StoragePath, columns: list[str] | None = None) -> ray.data.Dataset:
    """A lazy Ray Dataset over a folder of Parquet files on local, NFS, S3 or GCS storage."""
    paths = [file.path for file in parquet_files(folder)]
    return ray.data.read_parquet(paths, filesystem=folder.filesystem, columns=columns)


def device_batches(
    shard: ray.data.DataIterator,
    *,
    batch_size: int,
    collate_fn: ArrowBatchCollateFn,
    drop_last: bool,
    shuffle_buffer_rows: int | None = None,
    seed: int | None = None,
    prefetch_batches: int = 2,
) -> Iterable[Any]:
    """Batches of this worker's shard as tensors on the worker's device (from Ray Train, never cuda:0).

    The collate function runs in Ray Data's prefetch threads, so decoding and normalising overlap the
    training step; a local shuffle buffer mixes rows without a global shuffle's full data exchange.
    """
    device = ray.train.torch.get_device()
    return shard.iter_torch_batches(
        batch_size=batch_size,
        collate_fn=collate_fn,
        device=device,
        pin_memory=device.type == "cuda",
        drop_last=drop_last,
        local_shuffle_buffer_size=shuffle_buffer_rows,
        local_shuffle_seed=seed,
        prefetch_batches=prefetch_batches,
    )
