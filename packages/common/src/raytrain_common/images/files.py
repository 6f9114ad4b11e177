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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

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


def carve_held_out(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) indices: the held-out split `held_out_rows` long, shared over the classes
    in proportion (each class keeping an image for training), each class's drawn with a seed.
    An image tree's carve keys each file by a seeded hash of its path instead (tree_prep.py)."""
    rng = np.random.default_rng(seed)
    target = held_out_rows(len(labels), fraction)
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        count = min(len(members) - 1, max(1, round(target * len(members) / len(labels))))
        test.append(members[:count])
        train.append(members[count:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))
