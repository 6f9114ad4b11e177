"""Sharded checkpoints (DCP): every rank writes its shards and a manifest of them, every rank
reports, Ray merges the folders; a resume loads the shards into the current sharding (DCP reshards
for another worker count). `export` reads the same files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import Checkpoint, CheckpointUploadMode
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from llm_fsdp.loss import NextTokenLoss
from raytrain_common.checkpoint import UploadFn, new_scratch_folder, write_manifest

STATE_FILE = "train_state.json"  # step, data position, history: beside the DCP shards


def save_checkpoint(
    model: NextTokenLoss,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    metrics: dict[str, float],
    async_upload: bool = False,
    upload: UploadFn | None = None,
) -> None:
    # The LM's state alone, so the keys are a plain Hugging Face model's (export loads them).
    model_state, optimizer_state = get_state_dict(model.lm, optimizer)
    folder = new_scratch_folder("llm-fsdp-ckpt")
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    if dist.get_rank() == 0:
        (Path(folder) / STATE_FILE).write_text(json.dumps(state))
    # Each rank describes its own shards, last: a shard cut off is found before a resume.
    write_manifest(folder, rank=dist.get_rank(), world_size=dist.get_world_size())
    # Ray deletes the local folder once it is in storage: at once (sync), or after the background
    # upload (async), which is why the folder is not a context-managed temporary one.
    mode = CheckpointUploadMode.ASYNC if async_upload else CheckpointUploadMode.SYNC
    ray.train.report(
        metrics,
        checkpoint=Checkpoint.from_directory(folder),
        checkpoint_upload_mode=mode,
        delete_local_checkpoint_after_upload=True,
        checkpoint_upload_fn=upload,
    )


def load_checkpoint(
    model: NextTokenLoss, optimizer: torch.optim.Optimizer, folder: str
) -> dict[str, Any]:
    """Load shards into the current sharding (DCP reshards for another worker count)."""
    model_state, optimizer_state = get_state_dict(model.lm, optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(loaded, checkpoint_id=folder)
    set_state_dict(
        model.lm, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
    )
    return json.loads((Path(folder) / STATE_FILE).read_text())


def read_train_state(checkpoint: Checkpoint) -> dict[str, Any]:
    with checkpoint.as_directory() as folder:
        return json.loads((Path(folder) / STATE_FILE).read_text())
