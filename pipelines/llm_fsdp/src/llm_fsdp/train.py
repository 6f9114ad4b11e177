"""Train a causal LM with FSDP2 in every Ray Train worker, from packed Parquet blocks.

Read top to bottom: the learning-rate schedule, one step, evaluation,
sharded checkpoints, the per-worker loop, then the driver that checks everything and launches
`TorchTrainer`. The model comes from `model.py` and is sharded in `parallelize.py` only.
"""

from __future__ import annotations

import contextlib
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


# ---------------------------------------------------------------------------------------------
# The loop's components: each decides when it acts, and acts
# ---------------------------------------------------------------------------------------------


class MetricsLogger:
    """What the run reports: the window's loss and gradient norm (read once per window: the only
    host syncs of the loop), tokens/s and MFU, peak memory, and rank 0's lines and MLflow rows."""

    def __init__(
        self, loop_config: dict[str, Any], model: NextTokenLoss, micro: int, last_step: int
    ) -> None:
        self.config = TrainConfig(**loop_config["config"])
        self.seq_len = DatasetInfo(**loop_config["dataset"]).seq_len
        self.launched_at, self.last_step = loop_config["launched_at"], last_step
        self.device, self.rank = ray.train.torch.get_device(), dist.get_rank()
        self.tokens_per_rank_step = micro * self.config.grad_accum_steps * self.seq_len
        self.meter = ThroughputMeter(
            self.config.global_batch_size * self.seq_len,
            flops_per_item=model_flops_per_token(model, self.seq_len),
            peak_flops=(peak_bf16_flops(self.device) or 0.0) * dist.get_world_size(),
        )
        self.window_loss = torch.zeros((), device=self.device)
        self.sink = rank_zero_sink(loop_config, self.rank)
        self.row: dict[str, float] = {}

    def step_end(self, run: RunState, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Count the step; every --log-every-steps and at the last step, the window's row."""
        self.window_loss += loss_sum
        self.meter.step()
        if run.startup_s is None:
            run.startup_s = startup_seconds(self.launched_at, self.rank)
        self.row = {"step": run.step}
        if run.step % self.config.log_every_steps == 0 or run.step == self.last_step:
            self.row |= self.window_row(run.step, grad_norm)
            self.window_loss.zero_()

    def window_row(self, step: int, grad_norm: torch.Tensor) -> dict[str, float]:
        """One metrics row for the steps since the last one: loss, lr, throughput, MFU, memory."""
        rate = self.meter.window()
        row = {
            "train_loss": mean_window_loss(
                self.window_loss, self.tokens_per_rank_step * rate.steps, step
            ),
            "lr": learning_rate(step - 1, self.config),
            "grad_norm": float(grad_norm),
            "tokens_per_s": rate.items_per_s,
            "workers": dist.get_world_size(),  # changes when an elastic run shrinks or grows
        }
        if rate.mfu is not None:
            row["mfu"] = rate.mfu
        if (memory := peak_memory_gb(self.device)) is not None:
            row["peak_memory_gb"] = memory
        if self.rank == 0:
            mfu = f"  MFU {row['mfu']:.1%}" if "mfu" in row else ""
            peak = f"  peak {row['peak_memory_gb']:.1f} GiB" if "peak_memory_gb" in row else ""
            log.info(
                "step %d/%d  loss %.4f  lr %.2e  %.0f tokens/s  %s%s%s",
                *(step, self.config.max_steps, row["train_loss"], row["lr"], rate.items_per_s),
                *(eta(self.config.max_steps - step, rate.seconds_per_step), mfu, peak),
            )
        return row

    def record(self, run: RunState, validation: dict[str, float] | None) -> None:
        """The step's row, with its validation when there was one, in the history and MLflow (a
        validation in the store before the checkpoint reports it: a sweep may stop on it)."""
        self.row |= validation or {}
        if len(self.row) > 1:
            run.history.append(self.row)
            self.sink.log(self.row, run.step)
            if validation:
                self.sink.flush()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Evaluation and checkpoints are left out of tokens/s."""
        return self.meter.paused()

    def close(self) -> None:
        self.sink.close()  # sends what rank 0 queued (bounded wait)


class Validator:
    """Scores the validation split every --eval-every-steps and at the last step."""

    def __init__(
        self,
        model: NextTokenLoss,
        blocks: TokenBlocks,
        micro: int,
        config: TrainConfig,
        last_step: int,
    ) -> None:
        self.model, self.blocks, self.micro, self.config = model, blocks, micro, config
        self.device = ray.train.torch.get_device()
        self.policy = ValidationPolicy(every_steps=config.eval_every_steps, last_step=last_step)

    def maybe_validate(self, step: int) -> dict[str, float] | None:
        return self.validate(step) if self.policy.due(step) else None

    def validate(self, step: int) -> dict[str, float]:
        losses = evaluate(self.model, self.blocks, self.micro, self.config, self.device)
        if dist.get_rank() == 0:
            dtype = f"  (compute in {self.model.compute_dtype})" if step == 0 else ""
            log.info(
                "step %d  val loss %.4f  perplexity %.1f%s",
                *(step, losses["val_loss"], losses["val_perplexity"], dtype),
            )
        return losses


class Checkpointer:
    """Decides when the run checkpoints (every --checkpoint-every-steps, a preemption notice,
    --stop-at-step, the end: `CheckpointPolicy`) and writes sharded checkpoints from every rank
    (`checkpoint.py`, which calls `ray.train.report`); restores the run from the newest complete
    one, resharded to this worker count."""

    def __init__(
        self,
        model: NextTokenLoss,
        optimizer: torch.optim.Optimizer,
        loop_config: dict[str, Any],
        run_dir: StoragePath,
        last_step: int,
    ) -> None:
        self.config = config = TrainConfig(**loop_config["config"])
        self.model, self.optimizer, self.loop_config = model, optimizer, loop_config
        self.run_dir, self.driver_id = run_dir, loop_config["driver_id"]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.policy = CheckpointPolicy(
            every_steps=config.checkpoint_every_steps,
            last_step=last_step,
            stop_at_step=config.stop_at_step,
            preemption_check_steps=config.preemption_check_steps,
        )
        self.progress = ProgressNotes(
            run_dir, self.driver_id, self.world, config.log_every_steps, self.rank
        )
        self.upload = upload_with_retries(config.storage_path, config.storage_patience_s)

    def restore(self) -> RunState:
        """The newest complete checkpoint's state loaded into the model (resharded to this worker
        count), or a fresh start; either way the restart, if this is one, recorded with its cause."""
        checkpoint = resume_checkpoint(self.run_dir)
        if checkpoint is None:
            run = RunState()
            if read_progress(self.run_dir) is not None:  # lost before its first checkpoint
                run.faults.record_restart(0, self.run_dir, self.driver_id, None, self.world)
            return run
        with checkpoint.as_directory() as folder:
            state = load_checkpoint(self.model, self.optimizer, folder)
        run = RunState(
            step=state["step"],
            history=state["history"],
            faults=FaultLog(**state.get("faults", {})),
            startup_s=state.get("startup_s"),
        )
        if not self.policy.already_done(run.step):
            restart = run.faults.record_restart(
                run.step, self.run_dir, self.driver_id, checkpoint.path, self.world
            )
            if restart["cause"] == "rerun":  # this command's own start-up is measured anew
                run.startup_s = None
        if self.rank == 0:
            log.info(
                "resumed at step %d (written by %d worker(s)) on %d worker(s)",
                *(run.step, state["world_size"], self.world),
            )
        return run

    def report_again_if_lost(self, run: RunState) -> None:
        """This driver's worker group restarted (an elastic grow) after its last checkpoint was
        written but before Ray registered it: report that checkpoint again, or the run ends on an
        older one."""
        progress = read_progress(self.run_dir) or {}
        if self.policy.already_done(run.step) and progress.get("driver_id") == self.driver_id:
            self.save(run)

    def step_end(self, run: RunState) -> bool:
        """After every step, on every rank (a collective when it asks Ray about a preemption):
        checkpoint when the policy says so. True when the loop stops here."""
        due = self.policy.due(run.step, run.faults)
        self.progress.note(run.step, run.faults, checkpointing=bool(due))
        if due:
            self.save(run)
        return due.stops

    def save(self, run: RunState) -> None:
        """A sharded checkpoint of every rank, reported with the latest validation loss (Ray ranks
        checkpoints by it), and how long training waited for it (a metrics.csv row)."""
        saved = {
            **dataclasses.asdict(run),
            "sequences_seen": run.step * self.config.global_batch_size,
            "world_size": self.world,
            "compute_dtype": str(self.model.compute_dtype).removeprefix("torch."),
            "worker_peak_rss_mb": workers_peak_rss_mb(),  # on every rank: a collective
            "loop_config": self.loop_config,
        }
        stalled = time.perf_counter()
        metrics = {"step": run.step, **run.latest_val()}
        save_checkpoint(
            self.model, self.optimizer, saved, metrics, self.config.async_upload, self.upload
        )
        # In metrics.csv (this run's rows; a resumed run's history comes from its checkpoint,
        # which cannot hold its own stall).
        run.history.append({"step": run.step, "checkpoint_stall_s": time.perf_counter() - stalled})


# ---------------------------------------------------------------------------------------------
# The per-worker loop
# ---------------------------------------------------------------------------------------------


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every worker: build and shard → restore → for each step: train, log, maybe
    validate, maybe checkpoint → finish. When to log, validate and checkpoint is the components'
    (MetricsLogger, Validator, Checkpointer, above)."""
    config = TrainConfig(**loop_config["config"])
    quiet_ray_output(config.verbose)
    info = DatasetInfo(**loop_config["dataset"])
    rank, world = dist.get_rank(), dist.get_world_size()
    device = ray.train.torch.get_device()
    micro = per_worker_batch_size(config.global_batch_size, world, config.grad_accum_steps)
    spec = ModelSpec(**loop_config["model"])
    model, optimizer = build_sharded_model(spec, info, config, device, world)
    # The token files, read in place: a step reads its rows at their offsets (tokens.py).
    data_dir = resolve_storage(config.resolved_data_dir())
    train_blocks = stage_blocks(split_blocks(data_dir, "train", info), device)
    run_dir = resolve_storage(config.storage_path).join(config.run_name)
    last_step = min(config.max_steps, config.stop_at_step or config.max_steps)

    checkpointer = Checkpointer(model, optimizer, loop_config, run_dir, last_step)
    run = checkpointer.restore()
    logger = MetricsLogger(loop_config, model, micro, last_step)
    val_blocks = split_blocks(data_dir, "validation", info)
    validator = Validator(model, val_blocks, micro, config, last_step)
    if run.step == 0:  # the untrained model's loss: the curves' first point
        run.history.append({"step": 0, **validator.validate(0)})
    checkpointer.report_again_if_lost(run)
    try:
        for step in range(run.step + 1, last_step + 1):
            # Step s's rows: a pure function of (seed, s), cut the same way on any worker count.
            rows = global_batch_indices(
                step - 1, config.global_batch_size, len(train_blocks), config.seed
            )
            batches = [
                take_blocks(train_blocks, part, device)
                for part in micro_batches(rows, rank, world, config.grad_accum_steps)
            ]
            loss_sum, grad_norm = train_step(model, optimizer, batches, config, step)
            run.step = step
            logger.step_end(run, loss_sum, grad_norm)
            with logger.paused():
                logger.record(run, validator.maybe_validate(step))
                if checkpointer.step_end(run):
                    break
    finally:
        logger.close()


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
