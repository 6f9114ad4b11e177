"""Users' images: a class-per-folder tree of PNG / JPEG / WebP / … files of any size and mode, read
and resized with Ray Data into the same arrays the MNIST sources give.

Layouts (folder names are the class names, sorted; images may sit deeper inside a class folder):
    DIR/<class>/*.png                       test and validation splits are carved out, stratified,
                                            with a seed
    DIR/train/<class>/…  DIR/test/<class>/… the given test split (a lone val/ or validation/ is the
                                            test split too); validation is carved from train
    DIR/train/…  DIR/val/…  DIR/test/…      all three given

Transparency: palette images with a transparent colour and images with alpha (RGBA, LA, PA) are
composited onto white (BACKGROUND) before conversion, in prepare and predict alike.
"""

from __future__ import annotations

import logging
import os
import random
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
TEST_FOLDERS = ("test", "val", "valid", "validation")
VAL_FOLDERS = ("val", "valid", "validation")
BACKGROUND = 255  # what transparent pixels become: white, in every channel
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"})
# The default side: the images' median shorter side, within these bounds (28: MNIST's, the least
# ResNet's stride-32 stem handles well; 128: a CPU box still trains it; pass --image-size for 224).
MIN_DEFAULT_SIDE, MAX_DEFAULT_SIDE = 28, 128
SIZE_SAMPLE = 2000  # headers read to choose the size and channels
DECODE_BATCH = 256  # files per Ray Data task: a few MB of pixels at the largest default side
MAX_DECODE_BLOCKS = 4096  # object refs the driver holds for a tree's file list
# The most pixels one image may have: above it an image is refused (named, with its size) before it
# is decoded. A PNG or GIF of a few KB can declare a huge canvas (a decompression bomb), and a
# 16-bit scan of 100+ Mpx decodes to gigabytes in a task; 67 Mpx (8192²) holds any camera's photo.
MAX_IMAGE_PIXELS = 8192 * 8192
MIN_HELD_OUT_ROWS = 64  # a carved test split holds one evaluation batch while the data allows
MAX_HELD_OUT_SHARE = 0.2


class ImageFolderError(ValueError):
    """An image tree this pipeline cannot train on; the message names the file or folder."""


class ImageTooLargeError(ValueError):
    """An image over MAX_IMAGE_PIXELS (or one Pillow calls a decompression bomb)."""


def open_image(path: str | IO[bytes]) -> Any:
    """Open an image (its header only) and refuse it, naming it and the limit, if decoding it
    would take more than MAX_IMAGE_PIXELS pixels of memory."""
    from PIL import Image

    name = path if isinstance(path, str) else getattr(path, "name", "an image")
    limit = f"the limit of {MAX_IMAGE_PIXELS / 1e6:.0f} Mpx per image"
    try:
        with warnings.catch_warnings():  # Pillow warns above 89 Mpx; the check below decides
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(path)
    except Image.DecompressionBombError as error:  # not an OSError: Pillow's own, over 2× its limit
        raise ImageTooLargeError(f"{name} is over {limit} ({error})") from error
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        image.close()
        raise ImageTooLargeError(
            f"{name} is {width}×{height} pixels ({width * height / 1e6:.0f} Mpx), over {limit} "
            "(a decompression bomb, or far larger than training needs): shrink or remove it"
        )
    return image


@dataclass
class ImageTree:
    class_names: list[str]
    files: dict[str, list[tuple[str, int]]]  # "train", "test", "val" or "all" → (path, class id)
    skipped: dict[str, int] = field(default_factory=dict)  # non-image files, by suffix
    folder_names: dict[str, str] = field(default_factory=dict)  # split → its folder's own name


def is_image_tree(folder: Path) -> bool:
    """A folder of folders, or of images (then refused by `scan_tree` for lack of classes); an
    IDX folder holds neither."""
    return folder.is_dir() and any(
        p.is_dir() or p.suffix.lower() in IMAGE_SUFFIXES for p in folder.iterdir()
    )


def scan_tree(folder: Path) -> ImageTree:
    """The tree's classes and image files; an error naming the folder if it cannot train a classifier."""
    subfolders = {
        p.name.lower(): p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")
    }
    test_name = next((name for name in TEST_FOLDERS if name in subfolders), None)
    val_name = next((n for n in VAL_FOLDERS if n in subfolders and n != test_name), None)
    roots = (
        {"train": subfolders["train"], "test": subfolders[test_name]}
        if "train" in subfolders and test_name
        else {"all": folder}
    )
    if "train" in roots and val_name:
        roots["val"] = subfolders[val_name]
    skipped: Counter[str] = Counter()
    per_split: dict[str, dict[str, list[str]]] = {}
    for split, root in roots.items():
        classes: dict[str, list[str]] = {}
        for class_dir in sorted(
            p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
        ):
            paths = []
            for path in sorted(class_dir.rglob("*")):
                if not path.is_file() or any(
                    part.startswith(".") for part in path.relative_to(root).parts
                ):
                    continue
                if path.suffix.lower() in IMAGE_SUFFIXES:
                    paths.append(utf8_name(path))
                else:
                    skipped[path.suffix.lower() or "(none)"] += 1
            if paths:
                classes[class_dir.name] = paths
        loose = [p for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
        if loose and not classes:
            raise ImageFolderError(
                f"{root} holds {len(loose)} images but no class folders: put each class's images "
                f"in a folder named after the class ({root}/<class>/image.png)"
            )
        per_split[split] = classes
    train_classes = sorted(per_split.get("train", per_split.get("all", {})))
    where = roots.get("train", folder)
    if len(train_classes) < 2:
        found = (
            f"one class ({train_classes[0]!r})" if train_classes else "no class folder with images"
        )
        raise ImageFolderError(
            f"{where} has {found}: a classifier needs at least two class folders, each holding "
            f"images ({', '.join(IMAGE_SUFFIXES)})"
        )
    for held_out in ("test", "val"):
        unknown = sorted(set(per_split.get(held_out, {})) - set(train_classes))
        if unknown:
            raise ImageFolderError(
                f"{roots[held_out]} has classes {unknown} that {roots['train']} lacks: the "
                f"{held_out} classes must be among the training ones"
            )
    ids = {name: index for index, name in enumerate(train_classes)}
    files = {
        split: [(path, ids[name]) for name, paths in classes.items() for path in paths]
        for split, classes in per_split.items()
    }
    names = {split: root.name for split, root in roots.items()}
    return ImageTree(train_classes, files, dict(sorted(skipped.items())), names)


def utf8_name(path: Path) -> str:
    """The path as text; an error naming it (its undecodable bytes escaped) if the file system
    holds a name that is not UTF-8, which Arrow, Parquet and Ray Data cannot carry."""
    name = str(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(name).decode("utf-8", "backslashreplace")
        raise ImageFolderError(
            f"{shown} has a file name that is not valid UTF-8 (written in another encoding, e.g. "
            "Latin-1 from an old archive): rename it to UTF-8, e.g. `convmv -f latin1 -t utf8 -r "
            "--notest <tree>`, or move it out of the tree"
        ) from None
    return name


def choose_size_and_channels(paths: list[str], seed: int) -> tuple[int, int, dict[str, int]]:
    """(side, channels, modes seen) from a sample of image headers: the median shorter side within
    28..128, and 1 channel if every sampled image is grey, else 3 (RGB)."""
    sample = paths if len(paths) <= SIZE_SAMPLE else random.Random(seed).sample(paths, SIZE_SAMPLE)
    sides: list[int] = []
    modes: Counter[str] = Counter()
    for path in sample:
        try:
            with open_image(path) as image:
                sides.append(min(image.size))
                modes[image.mode] += 1
        except ImageTooLargeError as error:
            raise ImageFolderError(str(error)) from error
        except OSError as error:
            raise ImageFolderError(f"{path} is not an image PIL can open ({error})") from error
    side = int(np.clip(np.median(sides), MIN_DEFAULT_SIDE, MAX_DEFAULT_SIDE))
    channels = 1 if set(modes) <= GREY_MODES else 3
    return side, channels, dict(modes)


def load_image(path: str | IO[bytes], side: int, channels: int) -> np.ndarray:
    """One image (a path, or a file's bytes as a stream) as uint8 (side, side) or (side, side, 3): the shorter side resized to `side` and the
    centre cropped square, palette / alpha / 16-bit modes converted."""
    from PIL import Image, ImageOps

    with open_image(path) as image:  # refused here, before decoding, if it is too large
        image.load()  # decode now: a truncated file fails here, with its path
        if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
            array = np.asarray(image, dtype=np.float32)  # 4 bytes a pixel, within the pixel limit
            span = max(float(array.max() - array.min()), 1e-9)
            image = Image.fromarray(((array - array.min()) / span * 255).astype(np.uint8))
        converted = flatten_transparency(image).convert("L" if channels == 1 else "RGB")
        fitted = ImageOps.fit(converted, (side, side), method=Image.Resampling.BILINEAR)
        return np.asarray(fitted, dtype=np.uint8)


def flatten_transparency(image: Any) -> Any:
    """An image without transparency: alpha (or a palette's transparent colour) composited onto
    BACKGROUND. Converting such images straight to RGB/L keeps the hidden colour under transparent
    pixels (often black: an icon on black) and makes PIL warn once per palette file."""
    from PIL import Image

    if image.mode in ("P", "L", "RGB") and "transparency" in image.info:
        image = image.convert("RGBA")  # a transparent colour (PNG's tRNS), made an alpha channel
    elif image.mode in ("LA", "La", "PA"):
        image = image.convert("RGBA")
    if image.mode not in ("RGBA", "RGBa"):
        return image
    background = Image.new("RGBA", image.size, (BACKGROUND, BACKGROUND, BACKGROUND, 255))
    return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")


def decode_batch(batch: dict[str, np.ndarray], side: int, channels: int) -> dict[str, np.ndarray]:
    """Ray Data batch function: paths → fixed-size pixels, or the error that stopped a file."""
    pixels, errors = [], []
    empty = np.zeros((side, side) + ((3,) if channels == 3 else ()), np.uint8).tobytes()
    for path in batch["path"]:
        try:
            pixels.append(load_image(str(path), side, channels).tobytes())
            errors.append("")
        except (OSError, ValueError, SyntaxError) as error:  # PIL's decoders raise all three
            pixels.append(empty)
            errors.append(f"{type(error).__name__}: {error}")
    return {
        "pixels": np.array(pixels, dtype=object),
        "label": batch["label"],
        "path": batch["path"],
        "error": np.array(errors, dtype=object),
    }


@dataclass
class DecodeFailures:
    """Files that could not be decoded, counted over every split a prepare decodes."""

    tried: int = 0
    failed: int = 0
    shown: list[str] = field(default_factory=list)  # the first three, with their errors

    def message(self) -> str:
        return (
            f"{self.failed} of {self.tried} images cannot be decoded: {'; '.join(self.shown)}. "
            "Replace or remove them"
        )


def decode_in_order(
    paths: Sequence[str], labels: np.ndarray, side: int, channels: int, failures: DecodeFailures
) -> Iterator[pa.Table]:
    """Tables of (image, label) rows, the files decoded in Ray Data tasks across the cluster and
    yielded in the order given, a block at a time: the caller holds a few blocks, never the split.
    Unreadable files are counted into `failures` (their rows hold blank pixels)."""
    import ray.data

    files = pa.table({"path": pa.array(paths, pa.string()), "label": pa.array(labels, pa.int64())})
    per_block = max(DECODE_BATCH, -(-files.num_rows // MAX_DECODE_BLOCKS))
    dataset = ray.data.from_arrow(
        [files.slice(start, per_block) for start in range(0, files.num_rows, per_block)]
    ).map_batches(
        decode_batch, batch_size=DECODE_BATCH, fn_kwargs={"side": side, "channels": channels}
    )
    dataset.context.execution_options.preserve_order = True  # this dataset's own context
    failures.tried += files.num_rows
    for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
        bad = pc.not_equal(batch.column("error"), "")
        count = pc.sum(bad).as_py() or 0
        if count:
            failures.failed += count
            for row in batch.filter(bad).slice(0, 3 - len(failures.shown)).to_pylist():
                failures.shown.append(f"{row['path']} ({row['error']})")
        yield pa.table({"image": batch.column("pixels"), "label": batch.column("label")})


def held_out_rows(rows: int, fraction: float) -> int:
    return max(round(rows * fraction), min(MIN_HELD_OUT_ROWS, int(rows * MAX_HELD_OUT_SHARE)), 1)


def carve_held_out(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) indices: the held-out split `held_out_rows` long, shared over the classes
    in proportion (each class keeping an image for training), drawn with `seed`."""
    rng = np.random.default_rng(seed)
    target = held_out_rows(len(labels), fraction)
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        count = min(len(members) - 1, max(1, round(target * len(members) / len(labels))))
        test.append(members[:count])
        train.append(members[count:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))
