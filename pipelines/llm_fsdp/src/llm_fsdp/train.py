"""Train a causal LM with FSDP2 in every Ray Train worker, from packed Parquet blocks.

Read top to bottom: the learning-rate schedule and FLOPs, the data order, one step, evaluation,
sharded checkpoints, the per-worker loop, then the driver that checks everything and launches
`TorchTrainer`. The model comes from `model.py` and is sharded in `parallelize.py` only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as functional
from ray.train import Checkpoint
from ray.train.torch import TorchTrainer
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from llm_fsdp import __version__
from llm_fsdp.config import TrainConfig
from llm_fsdp.data import DataError, DatasetInfo, inspect_dataset, read_blocks
from llm_fsdp.model import ModelSpec, build_model, max_positions, parameter_count, resolve_model
from llm_fsdp.parallelize import parallelize
from raytrain_common.configs import (
    ConfigError,
    build_run_config,
    build_scaling_config,
    build_torch_config,
    per_worker_batch_size,
)
from raytrain_common.metrics import (
    SUMMARY_FILE,
    package_versions,
    plot_curves,
    write_metrics_csv,
    write_summary,
)
from raytrain_common.ray_start import start_ray_for_run
from raytrain_common.storage import StoragePath, check_writable, resolve_storage

log = logging.getLogger("llm_fsdp")

SCORE = "val_loss"
STATE_FILE = "train_state.json"  # step, data position, history: beside the DCP shards
METRICS_FILE = "metrics.csv"
CURVES_FILE = "curves.png"
# Dense bf16 peak FLOP/s by device name fragment, for MFU (NVIDIA data sheets, SXM parts).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Schedule and FLOPs: pure functions, so a resumed run needs only the step
# ---------------------------------------------------------------------------------------------


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up to `lr`, then cosine down to `lr × min_lr_ratio` at `max_steps`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(
        1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    )
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def flops_per_token(parameters: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls of weights, plus 12·L·H·T for attention."""
    return 6 * parameters + 12 * layers * hidden * seq_len


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


# ---------------------------------------------------------------------------------------------
# Data order: a seeded permutation per pass, consumed in global batches
# ---------------------------------------------------------------------------------------------


def global_batch_indices(
    step: int, global_batch_size: int, num_blocks: int, seed: int
) -> np.ndarray:
    """The blocks of optimiser step `step`: positions [step·G, (step+1)·G) of an endless stream of
    per-pass permutations. Depends on the step alone, so resuming on any worker count continues
    with exactly the next blocks."""
    positions = np.arange(step * global_batch_size, (step + 1) * global_batch_size)
    passes, offsets = np.divmod(positions, num_blocks)
    out = np.empty_like(positions)
    for one_pass in np.unique(passes):
        order = np.random.default_rng([seed, int(one_pass)]).permutation(num_blocks)
        out[passes == one_pass] = order[offsets[passes == one_pass]]
    return out


def micro_batches(indices: np.ndarray, rank: int, world: int, accum: int) -> list[np.ndarray]:
    """This rank's micro-batches of a global batch: rank-major within each accumulation step."""
    per_micro = len(indices) // (world * accum)
    return [
        indices[(a * world + rank) * per_micro : (a * world + rank + 1) * per_micro]
        for a in range(accum)
    ]


# ---------------------------------------------------------------------------------------------
# A step, an evaluation
# ---------------------------------------------------------------------------------------------


def token_loss_sum(model: torch.nn.Module, blocks: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over a batch of blocks (inputs: all but the last token)."""
    logits = model(input_ids=blocks[:, :-1]).logits
    return functional.cross_entropy(
        logits.flatten(0, 1).float(), blocks[:, 1:].flatten(), reduction="sum"
    )


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    config: TrainConfig,
    step: int,
) -> tuple[float, float]:
    """One optimiser step over this rank's micro-batches; returns (global mean loss, grad norm)."""
    lr = learning_rate(step, config)
    for group in optimizer.param_groups:
        group["lr"] = lr
    tokens_per_micro = batches[0].shape[0] * (batches[0].shape[1] - 1)
    local_sum = torch.zeros((), device=batches[0].device)
    for index, blocks in enumerate(batches):
        # Gradients are reduced across ranks once, after the last micro-batch.
        model.set_requires_gradient_sync(index == len(batches) - 1)
        loss_sum = token_loss_sum(model, blocks)
        # Normalised by token count: every micro-batch holds the same number of tokens (packed
        # blocks, no padding), and FSDP averages over ranks, so this is the global per-token mean.
        (loss_sum / (tokens_per_micro * len(batches))).backward()
        local_sum += loss_sum.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(local_sum)
    mean = local_sum.item() / (tokens_per_micro * len(batches) * dist.get_world_size())
    if not math.isfinite(mean):
        raise FloatingPointError(
            f"rank {dist.get_rank()}: training loss is {mean} at step {step + 1}: lower --lr, "
            "or raise --warmup-steps"
        )
    total_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return mean, float(total_norm)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    blocks: np.ndarray,
    micro: int,
    config: TrainConfig,
    device: torch.device,
) -> dict[str, float]:
    """Mean validation loss over the same first blocks every time (each rank its share), all-reduced."""
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    wanted = min(len(blocks), config.eval_batches * micro * world)
    mine = np.array_split(np.arange(wanted), world)[rank]
    totals = torch.zeros(2, device=device)
    # Every rank runs the same number of forward passes: FSDP's all-gathers need all ranks.
    for chunk in np.array_split(mine, max(1, math.ceil(wanted / world / micro))):
        if len(chunk):
            batch = torch.from_numpy(blocks[chunk]).to(device)
            totals[0] += token_loss_sum(model, batch)
            totals[1] += batch.shape[0] * (batch.shape[1] - 1)
        else:
            token_loss_sum(model, torch.from_numpy(blocks[:1]).to(device))
    dist.all_reduce(totals)
    model.train()
    loss = (totals[0] / totals[1]).item()
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50))}


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints (DCP): every rank writes its shards, every rank reports, Ray merges them
# ---------------------------------------------------------------------------------------------


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    metrics: dict[str, float],
) -> None:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    with tempfile.TemporaryDirectory(prefix="llm-fsdp-ckpt-") as folder:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
        if dist.get_rank() == 0:
            (Path(folder) / STATE_FILE).write_text(json.dumps(state))
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))


def load_checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str
) -> dict[str, Any]:
    """Load shards into the current sharding (DCP reshards for another worker count)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(loaded, checkpoint_id=folder)
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
    )
    return json.loads((Path(folder) / STATE_FILE).read_text())


# ---------------------------------------------------------------------------------------------
# The per-worker loop
# ---------------------------------------------------------------------------------------------


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and biases (1-D parameters)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    config = TrainConfig(**loop_config["config"])
    info = DatasetInfo(**loop_config["dataset"])
    spec = ModelSpec(**loop_config["model"])
    rank, world = dist.get_rank(), dist.get_world_size()
    device = ray.train.torch.get_device()
    micro = per_worker_batch_size(config.global_batch_size, world, config.grad_accum_steps)

    torch.manual_seed(config.seed)  # the same initial weights on every rank before sharding
    model = build_model(spec, vocab_size=info.vocab_size, seq_len=info.seq_len, eos_id=info.eos_id)
    parameters = parameter_count(model)
    model.to(device)
    parallelize(
        model,
        device_type=device.type,
        world_size=world,
        bf16=config.bf16,
        activation_checkpointing=config.activation_checkpointing,
    )
    optimizer = build_optimizer(model, config)

    data_dir = resolve_storage(config.resolved_data_dir())
    train_blocks, val_blocks = read_blocks(data_dir, "train"), read_blocks(data_dir, "validation")
    state: dict[str, Any] = {"step": 0, "history": []}
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = load_checkpoint(model, optimizer, folder)
        if rank == 0:
            log.info(
                "resumed at step %d (written by %d worker(s)) on %d worker(s)",
                state["step"],
                state["world_size"],
                world,
            )
    history: list[dict[str, float]] = state["history"]
    step = state["step"]
    peak = peak_flops(device)
    per_token = flops_per_token(
        parameters, model.config.num_hidden_layers, model.config.hidden_size, info.seq_len
    )
    latest_val: dict[str, float] = next((r for r in reversed(history) if "val_loss" in r), {})
    if step == 0:
        latest_val = evaluate(model, val_blocks, micro, config, device)
        history.append({"step": 0, **latest_val})
        if rank == 0:
            log.info(
                "step 0  val loss %.4f  perplexity %.1f",
                latest_val["val_loss"],
                latest_val["val_perplexity"],
            )

    window_started, window_tokens, window_losses = time.perf_counter(), 0, []
    last_step = min(config.max_steps, config.stop_at_step or config.max_steps)
    while step < last_step:
        indices = global_batch_indices(
            step, config.global_batch_size, len(train_blocks), config.seed
        )
        batches = [
            torch.from_numpy(train_blocks[part]).to(device)
            for part in micro_batches(indices, rank, world, config.grad_accum_steps)
        ]
        loss, grad_norm = train_step(model, optimizer, batches, config, step)
        step += 1
        window_tokens += config.global_batch_size * info.seq_len
        window_losses.append(loss)
        row: dict[str, float] | None = None
        if step % config.log_every_steps == 0 or step == last_step:
            elapsed = time.perf_counter() - window_started
            tokens_per_s = window_tokens / elapsed
            row = {
                "step": step,
                "train_loss": float(np.mean(window_losses)),
                "lr": learning_rate(step - 1, config),
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_s,
            }
            if peak is not None:
                row["mfu"] = tokens_per_s * per_token / (peak * world)
                row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            if rank == 0:
                log.info(
                    "step %d/%d  loss %.4f  lr %.2e  %.0f tokens/s%s",
                    step,
                    config.max_steps,
                    row["train_loss"],
                    row["lr"],
                    tokens_per_s,
                    f"  MFU {row['mfu']:.1%}" if "mfu" in row else "",
                )
            window_started, window_tokens, window_losses = time.perf_counter(), 0, []
        paused = time.perf_counter()  # evaluation and checkpoints are left out of tokens/s
        if step % config.eval_every_steps == 0 or step == last_step:
            latest_val = evaluate(model, val_blocks, micro, config, device)
            row = {**(row or {"step": step}), **latest_val}
            if rank == 0:
                log.info(
                    "step %d  val loss %.4f  perplexity %.1f",
                    step,
                    latest_val["val_loss"],
                    latest_val["val_perplexity"],
                )
        if row is not None:
            history.append(row)
        if step % config.checkpoint_every_steps == 0 or step == last_step:
            saved = {
                "step": step,
                "sequences_seen": step * config.global_batch_size,
                "world_size": world,
                "history": history,
                "loop_config": loop_config,
            }
            save_checkpoint(model, optimizer, saved, {"step": step, **latest_val})
        window_started += time.perf_counter() - paused


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def check_model_fits_data(spec: ModelSpec, info: DatasetInfo) -> None:
    limit = max_positions(spec)
    if limit is not None and info.seq_len > limit:
        raise ConfigError(
            f"the data's seq_len {info.seq_len} is above {spec.name}'s limit of {limit} positions: "
            f"rerun `llm-fsdp prepare --seq-len {limit} --force` (or shorter)"
        )


def run(config: TrainConfig) -> dict[str, Any]:
    """Check everything that can be checked, train, then write metrics, curves and summary.json."""
    started = time.perf_counter()
    config.validate()
    storage = resolve_storage(config.storage_path)
    check_writable(storage)
    data_dir = resolve_storage(config.resolved_data_dir())
    info = inspect_dataset(data_dir)
    spec = resolve_model(config.model, storage.path if storage.is_local else "")
    check_model_fits_data(spec, info)
    if info.blocks("train") < config.global_batch_size:
        raise DataError(
            f"{info.blocks('train')} training blocks make no global batch of {config.global_batch_size}: "
            "give a larger corpus, a shorter --seq-len or a smaller --global-batch-size"
        )
    config = dataclasses.replace(config, storage_path=storage.uri, data_dir=data_dir.uri)
    start_ray_for_run(config, storage, data_dir)

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": dataclasses.asdict(config),
            "dataset": dataclasses.asdict(info),
            "model": dataclasses.asdict(spec),
        },
        scaling_config=build_scaling_config(config),
        run_config=build_run_config(config, score_attribute=SCORE, score_order="min"),
        torch_config=build_torch_config(config),
    )
    log.info(
        "training %s (FSDP2) on %d blocks of %d tokens, %d worker(s), %d steps; run folder %s",
        spec.name, info.blocks("train"), info.seq_len, config.num_workers, config.max_steps, storage.join(config.run_name),
    )  # fmt: skip
    result = trainer.fit()
    return write_run_outputs(storage.join(config.run_name), result, config, info, spec, started)


def read_train_state(checkpoint: Checkpoint) -> dict[str, Any]:
    with checkpoint.as_directory() as folder:
        return json.loads((Path(folder) / STATE_FILE).read_text())


def write_run_outputs(
    run_dir: StoragePath,
    result: ray.train.Result,
    config: TrainConfig,
    info: DatasetInfo,
    spec: ModelSpec,
    started: float,
) -> dict[str, Any]:
    if result.checkpoint is None:
        raise RuntimeError(f"run {config.run_name} finished without a checkpoint under {run_dir}")
    state = read_train_state(result.checkpoint)
    history = state["history"]
    write_metrics_csv(run_dir.join(METRICS_FILE), history)
    plot_curves(
        run_dir.join(CURVES_FILE),
        history,
        [("loss", ["train_loss", "val_loss"]), ("tokens/s", ["tokens_per_s"])],
        x="step",
        title=f"{config.run_name}: {spec.name} on {info.source}",
        log_y=["loss"],
    )
    evals = [row for row in history if "val_loss" in row]
    best = result.get_best_checkpoint(SCORE, "min") if result.best_checkpoints else None
    summary = {
        "pipeline": "llm_fsdp",
        "pipeline_version": __version__,
        "run_name": config.run_name,
        "run_dir": run_dir.uri,
        "model": spec.name,
        "steps_done": state["step"],
        "first_eval": evals[0],
        "final_eval": evals[-1],
        "val_loss_drop": 1 - evals[-1]["val_loss"] / evals[0]["val_loss"],
        "tokens_per_s": float(
            np.median([r["tokens_per_s"] for r in history if "tokens_per_s" in r] or [0])
        ),
        "best_checkpoint": _uri(run_dir, best.path) if best else None,
        "latest_checkpoint": _uri(run_dir, result.checkpoint.path),
        "metrics_csv": run_dir.join(METRICS_FILE).uri,
        "curves_png": run_dir.join(CURVES_FILE).uri,
        "wall_time_s": time.perf_counter() - started,
        "config": dataclasses.asdict(config),
        "dataset": dataclasses.asdict(info),
        "versions": package_versions("transformers"),
    }
    write_summary(run_dir.join(SUMMARY_FILE), summary)
    return summary


def _uri(run_dir: StoragePath, path: str) -> str:
    if run_dir.is_local:
        return path
    return f"{run_dir.uri.split('://', 1)[0]}://{path}"
