"""The Ray Data batch functions that turn a prepared dataset's rows into pixels: raw pixel rows, an
image tree's files (fetched in parallel from any storage) or shards' encoded images → uint8 NCHW,
a file that fails skipped and named; and `prepare`'s check of every file. They run in Ray Data's
worker processes, so this module imports no torch (seconds per new process on a small box)."""

from __future__ import annotations

import concurrent.futures
import functools
import io

import numpy as np
import ray

from raytrain_common.storage import StoragePath, join_uri, resolve_storage

READ_THREADS = 16  # files fetched at once inside one decode task (object storage is latency-bound)
# The label of a row whose file could not be decoded in training: PyTorch's ignore_index, so the
# loss and the metrics leave the row out while it keeps its place in the epoch (task.py).
SKIPPED_LABEL = -100


# ---------------------------------------------------------------------------------------------


def node_tag() -> int:
    """This node's Ray id as a number a tensor column can carry (its first 15 hex digits)."""
    return int(ray.get_runtime_context().get_node_id()[:15], 16)


def to_nchw(images: np.ndarray) -> np.ndarray:
    """(n, H, W, C) uint8 → a fresh (n, C, H, W) array with plain NCHW strides. Not a transpose
    alone for one channel: numpy calls a transposed (n, 1, H, W) view contiguous, but torch then
    sees channels-last strides and picks other conv kernels (and DDP warns of grad strides)."""
    count, height, width, channels = images.shape
    if channels == 1:
        return images.reshape(count, 1, height, width).copy()
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2))


def pixels_from_bytes(
    batch: dict[str, np.ndarray], height: int, width: int, channels: int
) -> dict[str, np.ndarray]:
    """Raw pixel rows (MNIST, IDX sources) → uint8 (n, C, H, W); an error naming the sizes when a
    row is not height × width × channels bytes (inspect_dataset checks only the extremes)."""
    expected = height * width * channels
    lengths = {len(image) for image in batch["image"]}
    if lengths - {expected}:
        raise ValueError(
            f"pixel rows of {sorted(lengths)} bytes among rows {batch['row'][:3]}...; expected "
            f"{height}×{width}×{channels} = {expected} bytes each (dataset.json): the prepared "
            "Parquet was changed since it was prepared; prepare it again with --force"
        )
    flat = np.frombuffer(b"".join(batch["image"]), dtype=np.uint8)
    images = to_nchw(flat.reshape(len(batch["row"]), height, width, channels))
    return {
        "row": batch["row"],
        "label": batch["label"],
        "image": images,
        "decode_node": np.full(len(batch["row"]), node_tag(), dtype=np.int64),
    }


@functools.lru_cache(maxsize=4)
def image_root(uri: str) -> StoragePath:
    """The image tree's location, resolved once per process (an S3 client is not free)."""
    return resolve_storage(uri)


def read_file(root: StoragePath, relative: str) -> io.BytesIO | OSError:
    """A file's bytes, or the error reading it (a file removed since `prepare`, a storage fault):
    the caller decides what a missing file means."""
    try:
        return io.BytesIO(root.join(*relative.split("/")).read_bytes())
    except OSError as error:
        return error


def fetch(root: StoragePath, paths: list[str]) -> list[io.BytesIO | OSError]:
    """The files' bytes fetched in parallel: object storage answers each request in tens of ms.

    Not Ray Data's `with_column(..., download(...))`, for two reasons: it returns None for a file
    it cannot read and logs why only at debug level, where prepare's bad_files.csv and training's
    skip line name the cause; and it is slower here. The image pipeline's `bench_fetch` benchmark
    (2,048 PNG files of 0.9 KB, blocks of 256, best of 3 alternated rounds in one run, 2-core box shared
    with a training run, 2026-11-26): 1,777 ÷ 552 files/s = 3.22 from a local folder, 186 ÷ 108
    = 1.72 from an S3 protocol server on loopback."""
    with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
        return list(pool.map(functools.partial(read_file, root), paths))


def check_files(batch: dict[str, np.ndarray], root_uri: str) -> dict[str, np.ndarray]:
    """prepare's check of every file of a tree, in Ray Data tasks across the cluster: each image
    file (`kind` "image") read and decoded whole (images.check_image); the batch comes back with
    each file's shorter side and mode, or why it fails (`error`)."""
    from raytrain_common.images.files import check_image

    root = image_root(root_uri)
    count = len(batch["path"])
    sides = np.zeros(count, dtype=np.int64)
    modes = np.full(count, "", dtype=object)
    errors = np.full(count, "", dtype=object)
    images = np.flatnonzero(batch["kind"] == "image")
    paths = [str(batch["path"][i]) for i in images]
    for index, stream in zip(images, fetch(root, paths), strict=True):
        try:
            if isinstance(stream, OSError):
                raise stream
            sides[index], modes[index] = check_image(stream)
        except (OSError, ValueError, SyntaxError) as error:  # PIL's decoders raise all three
            errors[index] = f"{type(error).__name__}: {error}"
    return {**batch, "side": sides, "mode": modes, "error": errors}


def pixels_from_files(
    batch: dict[str, np.ndarray],
    root_uri: str,
    side: int,
    channels: int,
    error_column: bool = False,
    crop_scale: float | None = None,
) -> dict[str, np.ndarray]:
    """An image tree's (path) rows → uint8 (n, C, side, side), the files fetched in parallel and
    decoded here, in the Ray Data task (`decode_rows`)."""
    root = image_root(root_uri)
    paths = [str(path) for path in batch["path"]]
    where = [join_uri(root.uri, path) for path in paths]
    return decode_rows(batch, fetch(root, paths), where, side, channels, error_column, crop_scale)


def pixels_from_shards(
    batch: dict[str, np.ndarray],
    side: int,
    channels: int,
    error_column: bool = False,
    crop_scale: float | None = None,
) -> dict[str, np.ndarray]:
    """Shard rows (each image's file, encoded as it was: prepare --shards) → uint8 (n, C, side,
    side), decoded here, in the Ray Data task (`decode_rows`)."""
    streams: list[io.BytesIO | OSError] = [io.BytesIO(data) for data in batch["encoded"]]
    where = [f"the image with id {int(image_id)}" for image_id in batch["id"]]
    return decode_rows(batch, streams, where, side, channels, error_column, crop_scale)


def decode_rows(
    batch: dict[str, np.ndarray],
    streams: list[io.BytesIO | OSError],
    where: list[str],
    side: int,
    channels: int,
    error_column: bool,
    crop_scale: float | None,
) -> dict[str, np.ndarray]:
    """Each row's image decoded from its stream (`where` names it in errors).

    A file that fails (changed or removed since `prepare` checked it) never stops the run: its row
    keeps its place with blank pixels and the label SKIPPED_LABEL, which the loss and the metrics
    leave out, so the row still counts as consumed for the epoch and every rank still takes the
    same number of steps. With `error_column` the row also carries why, for the rank's log. With
    `crop_scale`, training's photo recipe: a random resized crop (down to that share of the area)
    and a flip, drawn anew every epoch, in place of the centre crop."""
    from raytrain_common.images.files import RandomResizedCrop, load_image

    crop = None if crop_scale is None else RandomResizedCrop(min_scale=crop_scale)
    labels = np.array(batch["label"], dtype=np.int64, copy=True)
    decoded, errors = [], []
    for index, (name, stream) in enumerate(zip(where, streams, strict=True)):
        try:
            if isinstance(stream, OSError):
                raise stream
            decoded.append(load_image(stream, side, channels, crop))
            errors.append("")
        except (OSError, ValueError, SyntaxError) as error:  # PIL's decoders raise all three
            decoded.append(np.zeros((side, side, channels)[: 3 if channels == 3 else 2], np.uint8))
            labels[index] = SKIPPED_LABEL
            errors.append(f"{name} ({type(error).__name__}: {error})")
    count = len(where)
    images = to_nchw(np.stack(decoded).reshape(count, side, side, channels))
    columns = {
        "row": batch["row"],
        "label": labels,
        "image": images,
        "decode_node": np.full(count, node_tag(), dtype=np.int64),
    }
    if error_column:
        columns["error"] = np.array(errors, dtype=object)
    return columns
