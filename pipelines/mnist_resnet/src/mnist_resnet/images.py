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
import posixpath
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from raytrain_common.storage import StoragePath

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
TEST_FOLDERS = ("test", "val", "valid", "validation")
VAL_FOLDERS = ("val", "valid", "validation")
BACKGROUND = 255  # what transparent pixels become: white, in every channel
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"})
# The default side: the images' median shorter side, within these bounds (28: MNIST's, the least
# ResNet's stride-32 stem handles well; 128: a CPU box still trains it; pass --image-size for 224).
MIN_DEFAULT_SIDE, MAX_DEFAULT_SIDE = 28, 128
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


def is_image_tree(source: str) -> bool:
    """An object-storage prefix (s3://, gs://: the only remote source), or a local folder of
    folders or of images (then refused by `scan_tree` for lack of classes); an IDX folder holds
    neither."""
    if "://" in source and not source.startswith("file://"):
        return True
    folder = Path(source.removeprefix("file://")).expanduser()
    return folder.is_dir() and any(
        p.is_dir() or p.suffix.lower() in IMAGE_SUFFIXES for p in folder.iterdir()
    )


def tree_files(root: StoragePath) -> list[str]:
    """Every file under `root` as a path relative to it ("a/b.png"), sorted; hidden files and
    folders left out. A local tree is walked with os.scandir, whose names are checked for UTF-8."""
    if not root.is_local:
        return [relative for relative, _ in root.walk_files()]
    found = []
    base = Path(root.path)
    for path in sorted(base.rglob("*")):
        relative = path.relative_to(base)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            found.append(
                utf8_name(relative) if path.suffix.lower() in IMAGE_SUFFIXES else str(relative)
            )
    return found


def scan_tree(root: StoragePath) -> ImageTree:
    """The tree's classes and image files (relative to `root`); an error naming the folder if it
    cannot train a classifier."""
    files = tree_files(root)
    top = {f.split("/", 1)[0] for f in files if "/" in f}
    subfolders = {name.lower(): name for name in sorted(top, reverse=True)}
    test_name = next((name for name in TEST_FOLDERS if name in subfolders), None)
    val_name = next((n for n in VAL_FOLDERS if n in subfolders and n != test_name), None)
    roots = (
        {"train": subfolders["train"] + "/", "test": subfolders[test_name] + "/"}
        if "train" in subfolders and test_name
        else {"all": ""}
    )
    if "train" in roots and val_name:
        roots["val"] = subfolders[val_name] + "/"
    skipped: Counter[str] = Counter()
    per_split = {
        split: split_classes(root, files, prefix, skipped) for split, prefix in roots.items()
    }
    train_classes = sorted(per_split.get("train", per_split.get("all", {})))
    where = root.join(roots["train"].rstrip("/")) if "train" in roots else root
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
                f"{root.join(roots[held_out].rstrip('/'))} has classes {unknown} that {where} "
                f"lacks: the {held_out} classes must be among the training ones"
            )
    ids = {name: index for index, name in enumerate(train_classes)}
    found_files = {
        split: [(path, ids[name]) for name, paths in classes.items() for path in paths]
        for split, classes in per_split.items()
    }
    names = {split: prefix.rstrip("/") for split, prefix in roots.items()}
    return ImageTree(train_classes, found_files, dict(sorted(skipped.items())), names)


def split_classes(
    root: StoragePath, files: list[str], prefix: str, skipped: Counter[str]
) -> dict[str, list[str]]:
    """The image files under `prefix`, by class folder (the files that are not images counted in
    `skipped` by suffix); an error when images lie there without class folders."""
    classes: dict[str, list[str]] = {}
    loose = 0
    for relative in files:
        if not relative.startswith(prefix):
            continue
        parts = relative[len(prefix) :].split("/")
        suffix = posixpath.splitext(parts[-1])[1].lower()
        if len(parts) == 1:
            loose += suffix in IMAGE_SUFFIXES
        elif suffix in IMAGE_SUFFIXES:
            classes.setdefault(parts[0], []).append(relative)
        else:
            skipped[suffix or "(none)"] += 1
    where = root.join(prefix.rstrip("/")) if prefix else root
    if loose and not classes:
        raise ImageFolderError(
            f"{where} holds {loose} images but no class folders: put each class's images "
            f"in a folder named after the class ({where}/<class>/image.png)"
        )
    return dict(sorted(classes.items()))


def utf8_name(path: Path | str) -> str:
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


def size_and_channels(sides: list[int], modes: dict[str, int]) -> tuple[int, int]:
    """(side, channels) of a tree from its checked files: the median shorter side within 28..128,
    and 1 channel if every image is grey, else 3 (RGB)."""
    side = int(np.clip(np.median(sides), MIN_DEFAULT_SIDE, MAX_DEFAULT_SIDE))
    channels = 1 if set(modes) <= GREY_MODES else 3
    return side, channels


def check_image(stream: IO[bytes]) -> tuple[int, str]:
    """(shorter side after EXIF orientation, mode) of one file, decoded whole: its header, the
    pixel limit and every byte of its compressed data are checked, so a truncated JPEG, an empty
    PNG or a web page saved as `.jpg` raises here (OSError, ValueError or SyntaxError, as Pillow's
    decoders do). A JPEG is decoded at an eighth of its size (`Image.draft`): all of its data is
    still read, at a fraction of the work."""
    with open_image(stream) as image:
        width, height = image.size
        mode = image.mode
        if image.format == "JPEG":
            image.draft(image.mode, (max(1, width // 8), max(1, height // 8)))
        image.load()
        return min(width, height), mode


def load_image(
    path: str | IO[bytes],
    side: int,
    channels: int,
    random_crop: RandomResizedCrop | None = None,
) -> np.ndarray:
    """One image (a path, or a file's bytes as a stream) as uint8 (side, side) or (side, side, 3):
    turned upright by its EXIF orientation (phone photos are stored sideways with a tag), palette /
    alpha / 16-bit modes converted, then the shorter side resized to `side` and the centre cropped
    square (validation, test, predict), or with `random_crop` a random crop of the picture resized
    to `side` (training's photo recipe). A JPEG larger than needed is decoded at a reduced scale
    (`Image.draft`: 1/2 to 1/8 of the work), never below what the crop needs."""
    from PIL import Image, ImageOps

    with open_image(path) as image:  # refused here, before decoding, if it is too large
        if image.format == "JPEG":
            least = side if random_crop is None else random_crop.source_side(side)
            image.draft("RGB" if channels == 3 else "L", (least, least))
        image.load()  # decode now: a truncated file fails here, with its path
        image = ImageOps.exif_transpose(image)
        if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
            array = np.asarray(image, dtype=np.float32)  # 4 bytes a pixel, within the pixel limit
            span = max(float(array.max() - array.min()), 1e-9)
            image = Image.fromarray(((array - array.min()) / span * 255).astype(np.uint8))
        converted = flatten_transparency(image).convert("L" if channels == 1 else "RGB")
        if random_crop is not None:
            return random_crop(converted, side)
        fitted = ImageOps.fit(converted, (side, side), method=Image.Resampling.BILINEAR)
        return np.asarray(fitted, dtype=np.uint8)


@dataclass(frozen=True)
class RandomResizedCrop:
    """The ImageNet training recipe's crop, drawn anew for every image and epoch: a window of
    `min_scale`..1 of the picture's area and aspect ratio 3/4..4/3 (torchvision's defaults: 0.08,
    RandomResizedCrop), resized to the training side, then a horizontal flip half the time."""

    min_scale: float = 0.08
    ratios: tuple[float, float] = (3 / 4, 4 / 3)

    def source_side(self, side: int) -> int:
        """The least side a picture needs for its smallest crop to still hold `side` pixels."""
        return int(np.ceil(side / np.sqrt(self.min_scale)))

    def window(self, width: int, height: int, rng: np.random.Generator) -> tuple[int, ...]:
        """(left, top, right, bottom) of one crop; the whole picture, cut to the ratio range,
        when ten draws miss (as torchvision falls back)."""
        log_ratios = np.log(self.ratios)
        for _ in range(10):
            area = width * height * rng.uniform(self.min_scale, 1.0)
            ratio = float(np.exp(rng.uniform(*log_ratios)))
            w, h = round(np.sqrt(area * ratio)), round(np.sqrt(area / ratio))
            if 0 < w <= width and 0 < h <= height:
                left, top = (
                    int(rng.integers(0, width - w + 1)),
                    int(rng.integers(0, height - h + 1)),
                )
                return left, top, left + w, top + h
        w = min(width, round(height * self.ratios[1]))
        h = min(height, round(width / self.ratios[0]))
        left, top = (width - w) // 2, (height - h) // 2
        return left, top, left + w, top + h

    def __call__(self, image: Any, side: int) -> np.ndarray:
        from PIL import Image

        rng = np.random.default_rng()
        box = self.window(image.width, image.height, rng)
        cropped = image.resize((side, side), Image.Resampling.BILINEAR, box=box)
        if rng.random() < 0.5:
            cropped = cropped.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(cropped, dtype=np.uint8)


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


def held_out_rows(rows: int, fraction: float) -> int:
    return max(round(rows * fraction), min(MIN_HELD_OUT_ROWS, int(rows * MAX_HELD_OUT_SHARE)), 1)


def carve_held_out(
    labels: np.ndarray, fraction: float, seed: int, keys: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) indices: the held-out split `held_out_rows` long, shared over the classes
    in proportion (each class keeping an image for training). Each class holds out its members
    with the smallest `keys` (a seeded hash of each file's path: a file added to or removed from
    the tree moves at most one other file of its class across the line), or a seeded draw."""
    rng = np.random.default_rng(seed)
    target = held_out_rows(len(labels), fraction)
    train, test = [], []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        members = rng.permutation(members) if keys is None else members[np.argsort(keys[members])]
        count = min(len(members) - 1, max(1, round(target * len(members) / len(labels))))
        test.append(members[:count])
        train.append(members[count:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))
