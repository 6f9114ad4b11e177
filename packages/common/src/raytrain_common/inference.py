"""Batch inference with Ray Data, as every pipeline's `predict` over a folder or a bucket does it:
the inputs read by Ray Data's tasks, a pool of actors holding one model each (a GPU each where the
cluster has them) classifying them batch by batch, and the predictions written as Parquet that
appears whole or not at all. Memory holds the batches in flight, not the inputs. A killed actor is
restarted and its batches retried, so no input is lost or written twice.

    source, target = inference.check_paths(location, output)   # refused before Ray starts
    init_ray(train_cpus=1)                                      # before Ray Data is touched
    rows = ray.data.read_binary_files(source.path, filesystem=source.filesystem, ...)
    written, seconds = inference.predict_to_parquet(rows, MyClassifier, {"checkpoint": c}, 256,
                                                   target)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from raytrain_common.storage import StoragePath, resolve_storage, write_folder_whole


def check_paths(
    location: str, output: str, input_flag: str = "--input"
) -> tuple[StoragePath, StoragePath]:
    """(the inputs, the output folder): the inputs must exist, the output must not (a command never
    overwrites what it did not make)."""
    source, target = resolve_storage(location), resolve_storage(output)
    if not source.exists():
        named = f"{input_flag} {location!r}".strip()
        raise FileNotFoundError(f"{named}: no such file, folder or bucket prefix")
    if target.exists():
        raise FileExistsError(f"--predictions {output!r} exists: choose a new path or remove it")
    return source, target


def model_actors() -> tuple[int, int]:
    """(actors, GPUs each): one per GPU of the cluster, else one per CPU but one (left to the read
    and write tasks)."""
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0))
    return (gpus, 1) if gpus else (max(1, int(ray.cluster_resources().get("CPU", 1)) - 1), 0)


def predict_to_parquet(
    rows: Any,
    model: type,
    model_kwargs: Mapping[str, Any],
    batch_size: int,
    target: StoragePath,
) -> tuple[Any, float]:
    """`rows` (a Ray Data dataset) through a pool of `model(**model_kwargs)` actors, written to
    `target` as Parquet; (the written files as a pyarrow dataset, to count without reading them,
    and the seconds it took)."""
    import pyarrow.dataset as pads

    actors, gpus = model_actors()
    started = time.perf_counter()
    predictions = rows.map_batches(
        model,
        fn_constructor_kwargs=dict(model_kwargs),
        batch_size=batch_size,
        concurrency=(1, actors),
        num_gpus=gpus,
        num_cpus=1,
    )
    write_folder_whole(
        target, lambda folder: predictions.write_parquet(folder.path, filesystem=folder.filesystem)
    )
    seconds = time.perf_counter() - started
    return pads.dataset(target.path, filesystem=target.filesystem, format="parquet"), seconds
