"""The Ray Data batch functions of the training stream's order and its exactly-once resume: a
resumed epoch's filter of the rows already trained, and the mix of a window of rows by a random
key. They run in Ray Data's worker processes, so this module imports no torch."""

from __future__ import annotations

import numpy as np


def epoch_seed(seed: int, epoch: int) -> int:
    """One 32-bit seed per (run seed, epoch)."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def bits_set(bits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Whether each row's bit is set in the bitmap `bits` (bit i: byte i // 8, bit i % 8)."""
    return ((bits[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1).astype(bool)


def drop_trained(batch: dict[str, np.ndarray], trained: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of `batch` whose positions (`row`) are not set in the bitmap `trained`."""
    keep = ~bits_set(trained, batch["row"])
    return {name: column[keep] for name, column in batch.items()}


def mix_window(batch: dict[str, np.ndarray], key: str) -> dict[str, np.ndarray]:
    """The rows of one window in the order of their random `key` column (drawn by Ray Data,
    reseeded every execution), the key dropped: a uniform permutation of the window."""
    order = np.argsort(batch[key], kind="stable")
    return {name: column[order] for name, column in batch.items() if name != key}
