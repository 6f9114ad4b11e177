"""Train a causal LM with FSDP2 in every Ray Train worker, from a memory-mapped token file.

Read top to bottom: the learning-rate schedule, one step, the sharded model and its optimiser, the
per-worker loop, then the driver that checks everything and launches `TorchTrainer`. The model
comes from `model.py` and is sharded (`fully_shard`) in `parallelize.py` only. The loop's
components, one click away: `metrics_logger.py` (what is logged, when), `validator.py` (when and
how the validation split is scored), `checkpointer.py` (when to checkpoint, the sharded DCP
checkpoint every rank writes, `ray.train.report`, how a run resumes) and `summary.py`
(metrics.csv, curves, summary.json).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import UserCallback
from ray.train.torch import TorchTrainer

from llm_fsdp.checkpointer import Checkpointer
from llm_fsdp.config import PREPARE_COMMAND, TrainConfig
from llm_fsdp.loss import NextTokenLoss
from llm_fsdp.metrics_logger import MetricsLogger
from llm_fsdp.model import (
    SMOLLM2,
    ModelError,
    ModelSpec,
    max_positions,
    meta_model,
    resolve_model,
)
from llm_fsdp.parallelize import UnsupportedModelError, check_parallelizable, parallelize
from llm_fsdp.run_state import RunState, WorkerContext
from llm_fsdp.summary import write_run_outputs
from llm_fsdp.task import build_model
from llm_fsdp.validator import SCORE, Validator, async_validation
from raytrain_common.checkpoint import resume_checkpoint
from raytrain_common.configs import (
    ConfigError,
    build_run_config,
    build_scaling_config,
    build_torch_config,
)
from raytrain_common.loop import StartupClock
from raytrain_common.ray_start import quiet_ray_output
from raytrain_common.runs import locate_run, start_run
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_common.tokens.corpus import DataError, DatasetInfo, inspect_dataset, split_blocks
from raytrain_common.tokens.file import ReadAhead, TokenBlocks
from raytrain_common.tokens.order import global_batch_indices, micro_batches
from raytrain_common.zero import name_cpu_accelerator

log = logging.getLogger("llm_fsdp")

__all__ = ["SCORE", "run", "train_loop_per_worker"]


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
# One step, and the model and optimiser it trains
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
    return to_device(source.take(indices), device)


def to_device(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    batch = torch.from_numpy(rows).long()
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch


class StepBatches:
    """This rank's micro-batches of each step, on the device. Step s's rows are a pure function of
    (seed, s), cut the same way on any worker count; so, from a token file, the next step's rows
    are read while this step trains (`ReadAhead`: on object storage each request waits tens of
    milliseconds), and from a split staged on the GPU they are cut there."""

    def __init__(
        self,
        source: TokenBlocks | torch.Tensor,
        config: TrainConfig,
        rank_of_world: tuple[int, int],
        device: torch.device,
        last_step: int,
    ) -> None:
        self.source, self.config, self.device, self.last_step = source, config, device, last_step
        self.rank, self.world = rank_of_world
        self.ahead = ReadAhead(source) if isinstance(source, TokenBlocks) else None
        self.planned: tuple[int, list[np.ndarray]] | None = None  # the step read ahead, its rows

    def rows(self, step: int) -> list[np.ndarray]:
        """Block indices of this rank's micro-batches of step `step` (1-based)."""
        config = self.config
        rows = global_batch_indices(
            step - 1, config.global_batch_size, len(self.source), config.seed
        )
        return micro_batches(rows, self.rank, self.world, config.grad_accum_steps)

    def __call__(self, step: int) -> list[torch.Tensor]:
        if self.ahead is None:
            return [take_blocks(self.source, part, self.device) for part in self.rows(step)]
        planned, self.planned = self.planned, None
        now = planned[1] if planned is not None and planned[0] == step else self.rows(step)
        if step < self.last_step:
            self.planned = (step + 1, self.rows(step + 1))  # each step's rows are drawn once
        rows = self.ahead.take(now, self.planned[1] if self.planned else None)
        return [to_device(part, self.device) for part in rows]

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()


def train_step(
    model: NextTokenLoss,
    optimizer: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    context: WorkerContext,
    *,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimiser step `step` (1-based) over this rank's micro-batches.

    Returns this rank's summed token loss and the global gradient norm as device tensors: reading
    them would make the host wait for the GPU every step, so the loop reads them when it logs.
    """
    config = context.config
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
        f"rank {rank}: out of GPU memory at step {step} with micro-batches of "
        f"{micro} × {seq_len} tokens: pass --grad-accum-steps {doubled} (the same "
        f"global batch in micro-batches of {micro // 2}), or --preset gpu-24gb on "
        "24 GB GPUs, or --activation-checkpointing; a smaller --loss-chunk-tokens "
        f"(now {config.loss_chunk_tokens}) helps when the vocabulary is large"
    )


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (all, or LoRA's adapters), fused into one kernel on
    GPUs; no weight decay on norms and biases (1-D parameters)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
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


# ---------------------------------------------------------------------------------------------
# The per-worker loop
# ---------------------------------------------------------------------------------------------


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every worker: build and shard → restore → for each step: train, log, maybe
    validate, maybe checkpoint → finish. When to log, validate and checkpoint is the components'
    (metrics_logger.py, validator.py, checkpointer.py)."""
    context = WorkerContext.parse(loop_config)  # the typed config, dataset and model, the batch
    config, info, last_step = context.config, context.info, context.last_step
    quiet_ray_output(config.verbose)
    name_cpu_accelerator()  # PEFT imports DeepSpeed where it is installed
    clock = StartupClock(loop_config["startup"])  # the driver's phases; rank 0 adds the rest
    clock.mark("worker_group")
    device = ray.train.torch.get_device()
    model, optimizer = build_sharded_model(context.spec, info, config, device, context.world)
    clock.mark("model_build")
    # The token files, read in place: a step reads its rows at their offsets, on object storage by
    # ranged requests (raytrain_common.tokens.file); never a copy of the split.
    data_dir = resolve_storage(config.resolved_data_dir())
    train_blocks = stage_blocks(split_blocks(data_dir, "train", info), device)

    run = RunState()  # the run's counters and history; its data position is its step
    checkpointer = Checkpointer(context, model=model, optimizer=optimizer, run=run)
    # Resume from this run's newest complete checkpoint, if any (a restarted worker group, a rerun).
    checkpointer.restore(resume_checkpoint(ray.train.get_checkpoint(), context.run_dir))
    logger = MetricsLogger(context, model, optimizer, clock)
    validator = Validator(model, split_blocks(data_dir, "validation", info), context)
    if run.step == 0:  # the untrained model's loss: the curves' first point
        run.history.append({"step": 0, **validator.validate(0)})
    checkpointer.report_again_if_lost()
    rank_of_world = (context.rank, context.world)
    batches_of = StepBatches(train_blocks, config, rank_of_world, device, last_step)
    try:
        for step in range(run.step + 1, last_step + 1):
            batches = batches_of(step)  # this rank's rows of the step; the next step's read ahead
            loss_sum, grad_norm = train_step(model, optimizer, batches, context, step=step)
            run.step = step
            logger.step_end(run, loss_sum=loss_sum, grad_norm=grad_norm)
            with logger.paused():
                validation = validator.maybe_validate(step)  # a collective when due
                logger.record(run, validation)
                # The step's other collectives: the preemption check, and a checkpoint's.
                if checkpointer.step_end(validation):
                    break
    finally:
        batches_of.close()
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
        return inspect_dataset(resolve_storage(config.resolved_data_dir()), PREPARE_COMMAND)
    except DataError as error:
        if config.model != SMOLLM2:
            raise
        raise DataError(
            f"{error}. SmolLM2 trains on its own tokens: `llm-fsdp prepare --tokenizer smollm2 "
            "--seq-len 1024` writes them where --model smollm2 looks"
        ) from error


def check_run(config: TrainConfig) -> tuple[TrainConfig, DatasetInfo, ModelSpec, StoragePath]:
    """Everything that can be checked before Ray starts: the options, the storage, the prepared
    tokens and the model that reads them. The config comes back with its steps (from --epochs)
    and paths resolved."""
    storage, data_dir = locate_run(config)
    config.validate_lora()  # before the model is looked for
    spec = dataclasses.replace(
        resolve_model(config.model, storage.path if storage.is_local else ""),
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        lora_targets=config.lora_targets(),
    )
    info = dataset_info(config)
    check_model_fits_data(spec, info)
    if info.blocks("train") < config.global_batch_size:
        raise DataError(
            f"{info.blocks('train')} training blocks make no global batch of "
            f"{config.global_batch_size}: "
            "give a larger corpus, a shorter --seq-len or a smaller --global-batch-size"
        )
    config = config.with_steps_for(info.blocks("train"))
    config.validate()
    log.info(
        "training %s (FSDP2) on %d blocks of %d tokens, %d worker(s), %d steps; run folder %s",
        *(spec.name, info.blocks("train"), info.seq_len, config.num_workers, config.max_steps),
        storage.join(config.run_name),
    )
    return (
        dataclasses.replace(config, storage_path=storage.uri, data_dir=data_dir.uri),
        info,
        spec,
        storage,
    )


def run(
    config: TrainConfig, callbacks: Sequence[UserCallback] = (), started_at: float | None = None
) -> dict[str, Any]:
    """Check everything that can be checked, train, then write metrics, curves and summary.json.

    `callbacks` join the run's (a sweep passes Tune's, which forwards every report to Tune);
    `started_at`: when the command started (time.time()), where its start-up is counted from.
    """
    clock = StartupClock(started_at)  # summary.json's startup_s, phase by phase
    config, info, spec, storage = check_run(config)
    inputs = {"the data folder (--data-dir)": resolve_storage(config.resolved_data_dir())}
    started = start_run(config, storage, inputs, clock)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=started.loop_config(config, dataset=info, model=spec),
        scaling_config=build_scaling_config(config),
        run_config=build_run_config(
            config, score_attribute=SCORE, score_order="min", callbacks=callbacks
        ),
        torch_config=build_torch_config(config),
        validation_config=async_validation(config, started.run_dir),  # None: inline, in the loop
    )
    with started.failures_named(config.storage_path):
        result = trainer.fit()  # the workers train; it returns when the run has ended
        summary = write_run_outputs(started.run_dir, result, config, info, spec, clock.began)
    return started.finish(summary)
