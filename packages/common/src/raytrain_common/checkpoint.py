"""Checkpoints for data-parallel runs: rank 0 writes, every rank reports, loading never runs pickled code.

`ray.train.report` is a barrier across the worker group: a rank that skips it leaves the others
waiting for ever. So the one function here that saves is called by every rank.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray.train
import torch
from torch import nn

STATE_FILE = "state.pt"
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_prefixes(
    state_dict: Mapping[str, Any], prefixes: tuple[str, ...] = WRAPPER_PREFIXES
) -> dict[str, Any]:
    """Remove the key prefixes DDP (`module.`) and torch.compile (`_orig_mod.`) add, however nested."""
    stripped = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in prefixes:
                if key.startswith(prefix):
                    key = key[len(prefix) :]
                    changed = True
        stripped[key] = value
    return stripped


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP / torch.compile wrappers, whose state dict has clean keys."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def save_state(folder: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
    """torch.save `state` into `folder/state.pt` atomically (temporary file, then rename)."""
    target = Path(folder) / STATE_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{STATE_FILE}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        torch.save(dict(state), temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target


def load_state(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Load `folder/state.pt` on the CPU with `weights_only=True`, so a checkpoint cannot run code."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {STATE_FILE} in checkpoint folder {str(folder)!r}")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_model_weights(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Load weights saved from a wrapped or plain model into a plain (or wrapped) one, strictly."""
    unwrap(model).load_state_dict(strip_prefixes(state_dict), strict=True)


def report_checkpoint(metrics: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Report `metrics` from every rank, with a checkpoint of `state` from rank 0 only.

    Under data parallelism every rank holds the same weights, so one copy is enough; the other ranks
    still call `ray.train.report`, which is a barrier. The temporary folder is removed once Ray has
    copied it to the run's storage (reports upload before returning).
    """
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(dict(metrics), checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="checkpoint-") as folder:
        save_state(folder, state)
        ray.train.report(dict(metrics), checkpoint=ray.train.Checkpoint.from_directory(folder))


def latest_state() -> dict[str, Any] | None:
    """The state of the run's latest checkpoint (after a failure or a rerun of the same run), if any."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        return load_state(folder)
