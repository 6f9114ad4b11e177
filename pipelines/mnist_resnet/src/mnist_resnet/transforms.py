"""This pipeline's augmentation recipe, run in Ray Data tasks on the decoded batches (the library
decodes: `raytrain_common.images`). Change it here: a batch function of {row, label, image (n, C,
H, W) uint8, ...} → the same, drawn anew every epoch as the dataset is executed again. It imports
no torch: it runs in Ray Data's worker processes."""

from __future__ import annotations

import numpy as np


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
