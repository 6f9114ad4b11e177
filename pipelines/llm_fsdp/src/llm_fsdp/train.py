"""Train a causal LM with FSDP2 in every Ray Train worker, from packed Parquet blocks.

Read top to bottom: the learning-rate schedule, one step, evaluation,
sharded checkpoints, the per-worker loop, then the driver that checks everything and launches
`TorchTrainer`. The model comes from `model.py` and is sharded in `parallelize.py` only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import UserCallback
from ray.train.torch import TorchTrainer

from llm_fsdp import __version__
from llm_fsdp.checkpoint import load_checkpoint, read_train_state, save_checkpoint
from llm_fsdp.config import TrainConfig
from llm_fsdp.data import DataError, DatasetInfo, inspect_dataset, split_blocks
from llm_fsdp.loss import NextTokenLoss
from llm_fsdp.model import (
    SMOLLM2,
    ModelError,
    ModelSpec,
    max_positions,
    meta_model,
    resolve_model,
)
from llm_fsdp.parallelize import UnsupportedModelError, check_parallelizable, parallelize
from llm_fsdp.task import build_model, model_flops_per_token, val_metrics
from llm_fsdp.tokens import TokenBlocks
from raytrain_common.checkpoint import (
    best_complete_checkpoint,
    resume_checkpoint,
    upload_with_retries,
)
from raytrain_common.configs import (
    ConfigError,
    build_run_config,
    build_scaling_config,
    build_torch_config,
    per_worker_batch_size,
)
from raytrain_common.faults import FaultLog, read_progress
from raytrain_common.hardware import peak_bf16_flops, peak_memory_gb, workers_peak_rss_mb
from raytrain_common.loop import (
    CheckpointPolicy,
    ProgressNotes,
    Throughput,
    ThroughputMeter,
    ValidationPolicy,
    startup_seconds,
)
from raytrain_common.metrics import (
    CURVES_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    eta,
    package_versions,
    plot_curves,
    write_metrics_csv,
    write_summary,
)
from raytrain_common.order import global_batch_indices, micro_batches
from raytrain_common.ray_start import quiet_ray_output, start_ray_for_run
from raytrain_common.runs import fit, locate_run, summary_header
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_common.tracking import (
    failed_on_error,
    finish_for_summary,
    open_for_config,
    rank_zero_sink,
    warm_tracking_store,
)

log = logging.getLogger("llm_fsdp")

SCORE = "val_loss"


# ---------------------------------------------------------------------------------------------
# The schedule: a pure function, so a resumed run needs only the step
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


# ---------------------------------------------------------------------------------------------
# A step, an evaluation
# ---------------------------------------------------------------------------------------------


def stage_blocks(blocks: TokenBlocks, device: torch.device) -> TokenBlocks | torch.Tensor:
    """Where batches are cut from: the split's token file, read block by block (memory: the batch),
    or, on a GPU whose free memory is 16× the split's size (Shakespeare in SmolLM2's tokens: 15 MB),
    the whole split staged on the GPU, where cutting a batch costs no host work at all."""
    if device.type != "cuda":
        return blocks
    free, _ = torch.cuda.mem_get_info(device)
    if blocks.nbytes * 2 >= free // 16:  # int64 on the GPU: twice the blocks as int32
        return blocks
    return torch.cat([torch.from_numpy(chunk).to(device).long() for chunk in blocks.read_all()])


def take_blocks(
    source: TokenBlocks | torch.Tensor, indices: np.ndarray, device: torch.device
) -> torch.Tensor:
    """Rows `indices` on `device`, without making the host wait for the GPU."""
    if isinstance(source, torch.Tensor):
        index = torch.from_numpy(indices).pin_memory().to(device, non_blocking=True)
        return source.index_select(0, index)
    rows = torch.from_numpy(source.take(indices)).long()
    if device.type == "cuda":
        return rows.pin_memory().to(device, non_blocking=True)
    return rows


def train_step(
    model: NextTokenLoss,
    optimizer: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    config: TrainConfig,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimiser step `step` (1-based) over this rank's micro-batches.

    Returns this rank's summed token loss and the global gradient norm as device tensors: reading
    them would make the host wait for the GPU every step, so the loop reads them when it logs.
    """
    lr = learning_rate(step - 1, config)
    for group in optimizer.param_groups:
        group["lr"] = lr
    micro, seq_len = batches[0].shape[0], batches[0].shape[1] - 1
    local_sum = torch.zeros((), device=batches[0].device)
    try:
        for index, blocks in enumerate(batches):
            # Gradients are reduced across ranks once, after the last micro-batch.
            model.set_requires_gradient_sync(index == len(batches) - 1)
            loss_sum = model(blocks)
            # Normalised by token count: every micro-batch holds the same number of tokens (packed
            # blocks, no padding), and FSDP averages over ranks: the global per-token mean.
            (loss_sum / (micro * seq_len * len(batches))).backward()
            local_sum += loss_sum.detach()
    except torch.OutOfMemoryError as error:
        raise MemoryError(out_of_memory_advice(config, micro, seq_len, step)) from error
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return local_sum, total_norm


def out_of_memory_advice(config: TrainConfig, micro: int, seq_len: int, step: int) -> str:
    """What to change when a step does not fit the GPU: the same global batch in smaller pieces."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    doubled = config.grad_accum_steps * 2
    return (
        f"rank {rank}: out of GPU memory at step {step} with micro-batches of {micro} × "
        f"{seq_len} tokens: pass --grad-accum-steps {doubled} (the same global batch in micro-batches "
        f"of {micro // 2}), or --preset gpu-24gb on 24 GB GPUs, or --activation-checkpointing; a "
        f"smaller --loss-chunk-tokens (now {config.loss_chunk_tokens}) helps when the vocabulary is large"
    )


def mean_window_loss(local_sums: torch.Tensor, tokens_per_rank: int, step: int) -> float:
    """The global per-token training loss of a window of steps (one collective, one host sync)."""
    total = local_sums.clone()
    dist.all_reduce(total)
    mean = total.item() / (tokens_per_rank * dist.get_world_size())
    if not math.isfinite(mean):
        raise FloatingPointError(
            f"rank {dist.get_rank()}: training loss is {mean} in the steps up to {step}: lower "
            "--lr, or raise --warmup-steps"
        )
    return mean


@torch.no_grad()
def evaluate(
    model: NextTokenLoss,
    blocks: TokenBlocks,
    micro: int,
    config: TrainConfig,
    device: torch.device,
) -> dict[str, float]:
    """Mean validation loss over the same first blocks every time (each rank its share), all-reduced.

    Eager even when the blocks are compiled: its batches' shapes vary, and compiling for them
    would recompile the training graphs with dynamic shapes.
    """
    with torch.compiler.set_stance("force_eager"):
        model.eval()
        rank, world = dist.get_rank(), dist.get_world_size()
        wanted = min(len(blocks), config.eval_batches * micro * world)
        mine = np.array_split(np.arange(wanted), world)[rank]
        totals = torch.zeros(2, device=device)
        # Every rank runs the same number of forward passes: FSDP's all-gathers need all ranks.
        for chunk in np.array_split(mine, max(1, math.ceil(wanted / world / micro))):
            if len(chunk):
                batch = torch.from_numpy(blocks.take(chunk)).to(device).long()
                totals[0] += model(batch)
                totals[1] += batch.shape[0] * (batch.shape[1] - 1)
            else:
                model(torch.from_numpy(blocks.take(np.arange(1))).to(device).long())
        dist.all_reduce(totals)
        model.train()
        loss_sum, tokens = totals.tolist()
        return val_metrics(loss_sum, tokens)


# ---------------------------------------------------------------------------------------------
# The per-worker loop
# ---------------------------------------------------------------------------------------------


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, fused into one kernel on GPUs; no weight decay on norms and biases (1-D parameters)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def build_sharded_model(
    spec: ModelSpec, info: DatasetInfo, config: TrainConfig, device: torch.device, world: int
) -> tuple[NextTokenLoss, torch.optim.Optimizer]:
    """The LM with its loss (task.py), sharded with FSDP2 (parallelize.py), and its optimizer."""
    torch.manual_seed(config.seed)  # the same initial weights on every rank before sharding
    model = build_model(spec, info, config.loss_chunk_tokens).to(device)
    parallelize(
        model,
        device_type=device.type,
        world_size=world,
        bf16=config.bf16,
        activation_checkpointing=config.activation_checkpointing,
        compile=config.compile,
    )
    return model, build_optimizer(model, config)


@dataclass
class RunState:
    """The run's record, saved in every checkpoint: steps done, metrics rows, faults survived, and
    the start-up time of the command that began this attempt."""

    step: int = 0
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    faults: FaultLog = dataclasses.field(default_factory=FaultLog)
    startup_s: float | None = None

    def latest_val(self) -> dict[str, float]:
        return next((row for row in reversed(self.history) if "val_loss" in row), {})


def resume_or_start(
    model: NextTokenLoss,
    optimizer: torch.optim.Optimizer,
    run_dir: StoragePath,
    driver_id: str,
    checkpoints: CheckpointPolicy,
) -> RunState:
    """The newest complete checkpoint's state loaded into the model (resharded to this worker
    count), or a fresh start; either way the restart, if this is one, recorded with its cause."""
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoint = resume_checkpoint(run_dir)
    if checkpoint is None:
        run = RunState()
        if read_progress(run_dir) is not None:  # lost before its first checkpoint: starts over
            run.faults.record_restart(0, run_dir, driver_id, None, world)
        return run
    with checkpoint.as_directory() as folder:
        state = load_checkpoint(model, optimizer, folder)
    run = RunState(
        step=state["step"],
        history=state["history"],
        faults=FaultLog(**state.get("faults", {})),
        startup_s=state.get("startup_s"),
    )
    if not checkpoints.already_done(run.step):
        restart = run.faults.record_restart(run.step, run_dir, driver_id, checkpoint.path, world)
        if restart["cause"] == "rerun":  # this command's own start-up is measured anew
            run.startup_s = None
    if rank == 0:
        log.info(
            "resumed at step %d (written by %d worker(s)) on %d worker(s)",
            run.step,
            state["world_size"],
            world,
        )
    return run


def window_row(
    step: int,
    rate: Throughput,
    window_loss: torch.Tensor,
    grad_norm: torch.Tensor,
    tokens_per_rank_step: int,
    config: TrainConfig,
    device: torch.device,
) -> dict[str, float]:
    """One metrics row for the steps since the last one: loss, lr, throughput, MFU, memory.
    The only host syncs of the loop: the reduced loss and the norm, once per window."""
    row = {
        "train_loss": mean_window_loss(window_loss, tokens_per_rank_step * rate.steps, step),
        "lr": learning_rate(step - 1, config),
        "grad_norm": float(grad_norm),
        "tokens_per_s": rate.items_per_s,
        "workers": dist.get_world_size(),  # changes when an elastic run shrinks or grows
    }
    if rate.mfu is not None:
        row["mfu"] = rate.mfu
    if (memory := peak_memory_gb(device)) is not None:
        row["peak_memory_gb"] = memory
    if dist.get_rank() == 0:
        log.info(
            "step %d/%d  loss %.4f  lr %.2e  %.0f tokens/s  %s%s%s",
            step,
            config.max_steps,
            row["train_loss"],
            row["lr"],
            rate.items_per_s,
            eta(config.max_steps - step, rate.seconds_per_step),
            f"  MFU {row['mfu']:.1%}" if "mfu" in row else "",
            f"  peak {row['peak_memory_gb']:.1f} GiB" if "peak_memory_gb" in row else "",
        )
    return row


def validate(
    model: NextTokenLoss,
    val_blocks: TokenBlocks,
    micro: int,
    config: TrainConfig,
    device: torch.device,
    step: int,
) -> dict[str, float]:
    losses = evaluate(model, val_blocks, micro, config, device)
    if dist.get_rank() == 0:
        log.info(
            "step %d  val loss %.4f  perplexity %.1f%s",
            step,
            losses["val_loss"],
            losses["val_perplexity"],
            f"  (compute in {model.compute_dtype})" if step == 0 else "",
        )
    return losses


def save(
    model: NextTokenLoss,
    optimizer: torch.optim.Optimizer,
    run: RunState,
    config: TrainConfig,
    loop_config: dict[str, Any],
) -> None:
    """A sharded checkpoint of every rank, reported with the latest validation loss (Ray ranks
    checkpoints by it), and how long training waited for it (a metrics.csv row)."""
    saved = {
        **dataclasses.asdict(run),
        "sequences_seen": run.step * config.global_batch_size,
        "world_size": dist.get_world_size(),
        "compute_dtype": str(model.compute_dtype).removeprefix("torch."),
        "worker_peak_rss_mb": workers_peak_rss_mb(),  # on every rank: a collective
        "loop_config": loop_config,
    }
    stalled = time.perf_counter()
    save_checkpoint(
        model,
        optimizer,
        saved,
        {"step": run.step, **run.latest_val()},
        config.async_upload,
        upload_with_retries(config.storage_path, config.storage_patience_s),
    )
    # In metrics.csv (this run's rows; a resumed run's history comes from its checkpoint, which
    # cannot hold its own stall).
    run.history.append({"step": run.step, "checkpoint_stall_s": time.perf_counter() - stalled})


def restarted_after_its_last_checkpoint(
    run: RunState, checkpoints: CheckpointPolicy, run_dir: StoragePath, driver_id: str
) -> bool:
    """True when this driver's worker group restarted (an elastic grow) after its last
    checkpoint was written but before Ray registered it: that checkpoint must be reported
    again, or the run ends on an older one."""
    return checkpoints.already_done(run.step) and (
        (read_progress(run_dir) or {}).get("driver_id") == driver_id
    )


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every worker: build and shard, restore, then for each step: train, log, and maybe
    validate and checkpoint (every N steps, a preemption notice, --stop-at-step, the end)."""
    config = TrainConfig(**loop_config["config"])
    quiet_ray_output(config.verbose)
    info = DatasetInfo(**loop_config["dataset"])
    spec = ModelSpec(**loop_config["model"])
    driver_id: str = loop_config["driver_id"]
    rank, world = dist.get_rank(), dist.get_world_size()
    device = ray.train.torch.get_device()
    micro = per_worker_batch_size(config.global_batch_size, world, config.grad_accum_steps)
    model, optimizer = build_sharded_model(spec, info, config, device, world)

    data_dir = resolve_storage(config.resolved_data_dir())
    train_blocks = stage_blocks(split_blocks(data_dir, "train", info), device)
    val_blocks = split_blocks(data_dir, "validation", info)
    run_dir = resolve_storage(config.storage_path).join(config.run_name)
    last_step = min(config.max_steps, config.stop_at_step or config.max_steps)
    checkpoints = CheckpointPolicy(
        every_steps=config.checkpoint_every_steps,
        last_step=last_step,
        stop_at_step=config.stop_at_step,
        preemption_check_steps=config.preemption_check_steps,
    )
    validation = ValidationPolicy(every_steps=config.eval_every_steps, last_step=last_step)
    run = resume_or_start(model, optimizer, run_dir, driver_id, checkpoints)
    progress = ProgressNotes(run_dir, driver_id, world, config.log_every_steps, rank)
    meter = ThroughputMeter(
        config.global_batch_size * info.seq_len,
        flops_per_item=model_flops_per_token(model, info.seq_len),
        peak_flops=(peak_bf16_flops(device) or 0.0) * world,
    )
    if run.step == 0:
        run.history.append({"step": 0, **validate(model, val_blocks, micro, config, device, 0)})
    elif restarted_after_its_last_checkpoint(run, checkpoints, run_dir, driver_id):
        save(model, optimizer, run, config, loop_config)
    window_loss = torch.zeros((), device=device)
    sink = rank_zero_sink(loop_config, rank)
    try:
        for step in range(run.step + 1, last_step + 1):
            indices = global_batch_indices(
                step - 1, config.global_batch_size, len(train_blocks), config.seed
            )
            batches = [
                take_blocks(train_blocks, part, device)
                for part in micro_batches(indices, rank, world, config.grad_accum_steps)
            ]
            loss_sum, grad_norm = train_step(model, optimizer, batches, config, step)
            window_loss += loss_sum
            meter.step()
            run.step = step
            if run.startup_s is None:
                run.startup_s = startup_seconds(loop_config["launched_at"], rank)
            row: dict[str, float] = {"step": step}
            if step % config.log_every_steps == 0 or step == last_step:
                row |= window_row(
                    step,
                    meter.window(),
                    window_loss,
                    grad_norm,
                    micro * config.grad_accum_steps * info.seq_len,
                    config,
                    device,
                )
                window_loss.zero_()
            due = checkpoints.due(step, run.faults)  # on every rank: may ask Ray (a barrier)
            with meter.paused():  # evaluation and checkpoints are left out of tokens/s
                if validation.due(step):
                    row |= validate(model, val_blocks, micro, config, device, step)
                if len(row) > 1:
                    run.history.append(row)
                    sink.log(row, step)
                    if "val_loss" in row:  # in the store before the checkpoint reports it (sweeps)
                        sink.flush()
                progress.note(step, run.faults, checkpointing=bool(due))
                if due:
                    save(model, optimizer, run, config, loop_config)
            if due.stops:
                break
    finally:
        sink.close()  # sends what rank 0 queued (bounded wait)


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def check_model_fits_data(spec: ModelSpec, info: DatasetInfo) -> None:
    """The model can be sharded and trained on this data: its blocks and loss head are where
    parallelize.py and loss.py look (on a meta-device copy), and the blocks fit its positions."""
    try:
        check_parallelizable(
            meta_model(spec, vocab_size=info.vocab_size, seq_len=info.seq_len, eos_id=info.eos_id)
        )
    except UnsupportedModelError as error:
        raise ModelError(f"{spec.name}: {error}") from error
    limit = max_positions(spec)
    if limit is not None and info.seq_len > limit:
        raise ConfigError(
            f"the data's seq_len {info.seq_len} is above {spec.name}'s limit of {limit} positions: "
            f"rerun `llm-fsdp prepare --seq-len {limit} --force` (or shorter)"
        )


def dataset_info(config: TrainConfig) -> DatasetInfo:
    """The prepared dataset the config points at; for SmolLM2, the error names its own prepare."""
    try:
        return inspect_dataset(resolve_storage(config.resolved_data_dir()))
    except DataError as error:
        if config.model != SMOLLM2:
            raise
        raise DataError(
            f"{error}. SmolLM2 trains on its own tokens: `llm-fsdp prepare --tokenizer smollm2 "
            "--seq-len 1024` writes them where --model smollm2 looks"
        ) from error


def run(config: TrainConfig, callbacks: Sequence[UserCallback] = ()) -> dict[str, Any]:
    """Check everything that can be checked, train, then write metrics, curves and summary.json.

    `callbacks` join the run's (a sweep passes Tune's, which forwards every report to Tune).
    """
    started, launched_at = time.perf_counter(), time.time()
    storage, data_dir = locate_run(config)
    spec = resolve_model(config.model, storage.path if storage.is_local else "")
    info = dataset_info(config)
    check_model_fits_data(spec, info)
    if info.blocks("train") < config.global_batch_size:
        raise DataError(
            f"{info.blocks('train')} training blocks make no global batch of {config.global_batch_size}: "
            "give a larger corpus, a shorter --seq-len or a smaller --global-batch-size"
        )
    config = config.with_steps_for(info.blocks("train"))
    config.validate()
    config = dataclasses.replace(config, storage_path=storage.uri, data_dir=data_dir.uri)
    warm_tracking_store(config, storage)  # overlaps Ray's start
    start_ray_for_run(config, storage, data_dir)
    tracked = open_for_config(config, storage, pipeline="llm_fsdp", version=__version__)

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": dataclasses.asdict(config),
            "dataset": dataclasses.asdict(info),
            "model": dataclasses.asdict(spec),
            "driver_id": uuid.uuid4().hex,  # tells a worker restart from a rerun of the command
            "launched_at": launched_at,
            "tracked": dataclasses.asdict(tracked) if tracked else None,
        },
        scaling_config=build_scaling_config(config),
        run_config=build_run_config(
            config, score_attribute=SCORE, score_order="min", callbacks=callbacks
        ),
        torch_config=build_torch_config(config),
    )
    log.info(
        "training %s (FSDP2) on %d blocks of %d tokens, %d worker(s), %d steps; run folder %s",
        spec.name,
        info.blocks("train"),
        info.seq_len,
        config.num_workers,
        config.max_steps,
        storage.join(config.run_name),
    )
    run_dir = storage.join(config.run_name)
    with failed_on_error(tracked):
        result = fit(trainer, config.storage_path)
        summary = write_run_outputs(run_dir, result, config, info, spec, started)
    finish_for_summary(tracked, run_dir, summary)
    return summary


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
    best = best_complete_checkpoint(result, SCORE, "min")
    windows = [row for row in history if "tokens_per_s" in row]
    # The first window holds the compilation and warm-up: the steady figures leave it out.
    steady = windows[1:] or windows
    summary = {
        **summary_header("llm_fsdp", __version__, config.run_name, run_dir),
        "model": spec.name,
        "steps_done": state["step"],
        "epochs_done": round(state["step"] * config.global_batch_size / info.blocks("train"), 4),
        "startup_s": state.get("startup_s"),
        **FaultLog(**state.get("faults", {})).summary(),
        "first": evals[0],
        "final": evals[-1],
        "best": min(evals, key=lambda row: row["val_loss"]),
        "val_loss_drop": 1 - evals[-1]["val_loss"] / evals[0]["val_loss"],
        "tokens_per_s": float(np.median([r["tokens_per_s"] for r in steady] or [0])),
        "mfu": _median_of(steady, "mfu"),
        "peak_memory_gb": max(
            (r["peak_memory_gb"] for r in windows if "peak_memory_gb" in r), default=None
        ),
        "compute_dtype": state.get("compute_dtype"),
        "worker_peak_rss_mb": state.get("worker_peak_rss_mb"),
        "checkpoint_stall_s": _median_of(history, "checkpoint_stall_s"),
        "best_checkpoint": run_dir.uri_for(best.path) if best else None,
        "latest_checkpoint": run_dir.uri_for(result.checkpoint.path),
        "metrics_csv": run_dir.join(METRICS_FILE).uri,
        "curves_png": run_dir.join(CURVES_FILE).uri,
        "wall_time_s": time.perf_counter() - started,
        "config": dataclasses.asdict(config),
        "dataset": dataclasses.asdict(info),
        "versions": package_versions("transformers"),
    }
    write_summary(run_dir.join(SUMMARY_FILE), summary)
    return summary


def _median_of(rows: list[dict[str, float]], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return float(np.median(values)) if values else None
