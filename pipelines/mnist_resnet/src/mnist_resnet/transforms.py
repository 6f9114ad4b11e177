"""The Ray Data batch functions of ingest.py: rows → pixels, augmentation, a resumed epoch's
filter. They run in Ray Data's worker processes, so this module imports no torch (seconds per new
process on a small box)."""

from __future__ import annotations

import concurrent.futures
import functools
import io
import posixpath

import numpy as np
import ray

from raytrain_common.storage import StoragePath, resolve_storage

READ_THREADS = 16  # files fetched at once inside one decode task (object storage is latency-bound)


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
    """Raw pixel rows (MNIST, IDX sources) → uint8 (n, C, H, W)."""
    flat = np.frombuffer(b"".join(batch["image"]), dtype=np.uint8)
    images = to_nchw(flat.reshape(len(batch["id"]), height, width, channels))
    return {
        "id": batch["id"],
        "label": batch["label"],
        "image": images,
        "decode_node": np.full(len(batch["id"]), node_tag(), dtype=np.int64),
    }


@functools.lru_cache(maxsize=4)
def image_root(uri: str) -> StoragePath:
    """The image tree's location, resolved once per process (an S3 client is not free)."""
    return resolve_storage(uri)


def read_file(root: StoragePath, relative: str) -> io.BytesIO:
    return io.BytesIO(root.join(*relative.split("/")).read_bytes())


def pixels_from_files(
    batch: dict[str, np.ndarray],
    root_uri: str,
    side: int,
    channels: int,
    report_errors: bool = False,
) -> dict[str, np.ndarray]:
    """An image tree's (path) rows → uint8 (n, C, side, side): the files fetched in parallel
    (object storage answers each request in tens of ms) and decoded here, in the Ray Data task.
    A file that cannot be decoded stops the task, named; with `report_errors` (prepare's check) it
    gets blank pixels and its error in an `error` column instead."""
    from mnist_resnet.images import load_image

    root = image_root(root_uri)
    paths = [str(path) for path in batch["path"]]
    with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
        streams = list(pool.map(functools.partial(read_file, root), paths))
    decoded, errors = [], []
    for path, stream in zip(paths, streams, strict=True):
        try:
            decoded.append(load_image(stream, side, channels))
            errors.append("")
        except (OSError, ValueError, SyntaxError) as error:  # PIL's decoders raise all three
            where = posixpath.join(root.uri, path)
            if not report_errors:
                raise ValueError(
                    f"{where} cannot be decoded ({type(error).__name__}: {error}): replace or "
                    "remove it, then run `mnist-resnet prepare --force`"
                ) from error
            decoded.append(np.zeros((side, side, channels)[: 3 if channels == 3 else 2], np.uint8))
            errors.append(f"{where} ({type(error).__name__}: {error})")
    images = to_nchw(np.stack(decoded).reshape(len(paths), side, side, channels))
    columns = {
        "id": batch["id"],
        "label": batch["label"],
        "image": images,
        "decode_node": np.full(len(paths), node_tag(), dtype=np.int64),
    }
    if report_errors:
        columns["error"] = np.array(errors, dtype=object)
    return columns


def augment(batch: dict[str, np.ndarray], pad: int, flip: bool) -> dict[str, np.ndarray]:
    """Random crop of the image padded by `pad` pixels (reflected), and with `flip` a horizontal
    flip of half the images: new draws every epoch, as the dataset is executed again."""
    rng = np.random.default_rng()
    images = batch["image"]
    count, _, height, width = images.shape
    padded = np.pad(images, ((0, 0), (0, 0), (pad, pad), (pad, pad)), mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, (height, width), axis=(2, 3))
    rows, cols = rng.integers(0, 2 * pad + 1, count), rng.integers(0, 2 * pad + 1, count)
    cropped = windows[np.arange(count), :, rows, cols]  # (n, C, H, W)
    if flip:
        flipped = rng.random(count) < 0.5
        cropped[flipped] = cropped[flipped][..., ::-1]
    return {**batch, "image": np.ascontiguousarray(cropped)}


def bits_set(bits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Whether each id's bit is set in the bitmap `bits` (bit i: byte i // 8, bit i % 8)."""
    return ((bits[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1).astype(bool)


def drop_trained(batch: dict[str, np.ndarray], trained: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of `batch` whose ids are not set in the bitmap `trained`."""
    keep = ~bits_set(trained, batch["id"])
    return {name: column[keep] for name, column in batch.items()}
