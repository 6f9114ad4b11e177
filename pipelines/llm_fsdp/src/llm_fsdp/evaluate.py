"""A checkpoint's next-token loss and perplexity on a split, in one process: what `train` reports
once, as it ends, for the checkpoint the validation split chose (on the held-out test documents),
and what `llm-fsdp evaluate` reports for any other checkpoint or split.

The sharded checkpoint is consolidated into one plain model (export.py's `load_consolidated`), so
scoring needs no process group and works for a checkpoint written by any number of workers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch

from llm_fsdp.checkpointer import STATE_FILE
from llm_fsdp.config import PREPARE_COMMAND
from llm_fsdp.export import load_consolidated
from llm_fsdp.task import val_metrics, with_loss
from raytrain_common.storage import resolve_storage
from raytrain_common.tokens.corpus import DataError, inspect_dataset, split_blocks

SCORE_BATCH_BLOCKS = 8  # blocks per forward pass: a batch of activations, never the split's


@torch.inference_mode()
def score_checkpoint(
    checkpoint: str, data_dir: str, split: str, max_blocks: int | None
) -> dict[str, Any]:
    """Mean next-token loss and perplexity of `checkpoint` over `split`'s first `max_blocks` blocks
    (all: None), on this process's GPU if it has one; keys prefixed by the split (`test_loss`)."""
    started = time.perf_counter()
    location = resolve_storage(checkpoint)
    # A checkpoint on S3 or GCS is copied to a scratch folder first; a local one is read in place.
    with ray.train.Checkpoint(location.path, location.filesystem).as_directory() as folder:
        lm, loop_config = load_consolidated(Path(folder))
        step = json.loads((Path(folder) / STATE_FILE).read_text())["step"]
    data = resolve_storage(data_dir)
    info = inspect_dataset(data, PREPARE_COMMAND)
    trained_on = loop_config["dataset"]
    if (info.vocab_size, info.seq_len) != (trained_on["vocab_size"], trained_on["seq_len"]):
        raise DataError(
            f"{checkpoint} was trained on {trained_on['vocab_size']:,}-token blocks of "
            f"{trained_on['seq_len']}, the data at {data.uri} has {info.vocab_size:,} and "
            f"{info.seq_len}: score it on the data it trained on"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = with_loss(lm, loop_config["config"]["loss_chunk_tokens"]).to(device).eval()
    blocks = split_blocks(data, split, info)
    wanted = len(blocks) if max_blocks is None else min(len(blocks), max_blocks)
    loss_sum, tokens = 0.0, 0
    for start in range(0, wanted, SCORE_BATCH_BLOCKS):
        rows = np.arange(start, min(wanted, start + SCORE_BATCH_BLOCKS))
        batch = torch.from_numpy(blocks.take(rows)).to(device).long()
        loss_sum += float(model(batch))
        tokens += batch.shape[0] * (batch.shape[1] - 1)
    blocks.close()
    prefix = {"validation": "val"}.get(split, split)  # test_* as every pipeline reports it
    metrics = {
        name.replace("val_", f"{prefix}_"): value
        for name, value in val_metrics(loss_sum, tokens).items()
    }
    return {
        "split": split,
        **metrics,
        f"{prefix}_blocks": wanted,
        f"{prefix}_tokens": tokens,
        "checkpoint": checkpoint,
        "step": step,
        f"{prefix}_s": time.perf_counter() - started,
    }
