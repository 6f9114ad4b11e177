"""Data-parallel training of ResNet18 on MNIST (or an image tree) with Ray Train and Ray Data.

Read top to bottom: the optimiser and schedule, one step, the per-worker loop, then the driver that
checks the inputs, builds the datasets and launches `TorchTrainer`. The loop's components, one
click away: `metrics_logger.py` (what is logged, when), `validator.py` (when and how the
validation split is scored), `checkpointer.py` (when to checkpoint, what a checkpoint holds,
`ray.train.report`, how a run resumes), and `summary.py` (summary.json and the test split, once).

Data: Ray Data reads, shuffles, decodes and augments the images (`raytrain_common.images`, this
pipeline's augmentation in transforms.py) and streams each worker
its shard: `ray.train.get_dataset_shard("train").iter_torch_batches(...)`. Every epoch is a fresh
permutation; every row is trained once per epoch, also across a resume on another worker count
(the checkpoint keeps the epoch's trained rows; a resumed epoch reads the rest).
Checkpoints are ranked by validation accuracy; the test split is evaluated once, on the chosen one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import ray.train
import ray.train.torch
import torch
from ray.train import UserCallback
from ray.train.torch import TorchTrainer
from torch import nn

from mnist_resnet.checkpointer import Checkpointer
from mnist_resnet.config import PREPARE_COMMAND, TrainConfig
from mnist_resnet.metrics_logger import THROUGHPUT_SKIP_STEPS, EpochTotals, MetricsLogger
from mnist_resnet.run_state import RunState, WorkerContext, steps_per_epoch, training_rows
from mnist_resnet.summary import finished_run_summary, write_run_outputs
from mnist_resnet.task import autocast, build_model, loss_fn, on_device
from mnist_resnet.transforms import augment
from mnist_resnet.validator import SCORE, Validator, async_validation
from raytrain_common.checkpoint import resume_checkpoint
from raytrain_common.configs import (
    ConfigError,
    build_run_config,
    build_scaling_config,
    build_torch_config,
    node_labels,
)
from raytrain_common.images.dataset import DatasetInfo, inspect_dataset
from raytrain_common.images.stream import ImageData, TrainingBatch
from raytrain_common.ingest.data_config import (
    REST_OF_EPOCH,
    TRAIN,
    VAL,
    EvenTrainingEveryValidationRow,
)
from raytrain_common.ingest.epochs import TrainingRows, check_resumable
from raytrain_common.ingest.order import epoch_seed
from raytrain_common.ingest.watch import IngestNodeWatch, check_cpus_for_ingest
from raytrain_common.loop import StartupClock
from raytrain_common.ray_start import quiet_ray_output
from raytrain_common.runs import locate_run, start_run
from raytrain_common.storage import StoragePath, resolve_storage

log = logging.getLogger("mnist_resnet")

__all__ = ["SCORE", "THROUGHPUT_SKIP_STEPS", "run", "train_loop_per_worker"]


# ---------------------------------------------------------------------------------------------
# Optimiser and schedule (shared with baseline.py, so both train the same way)
# ---------------------------------------------------------------------------------------------


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum; no weight decay on BatchNorm and bias parameters."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.SGD(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.lr,
        momentum=config.momentum,
        nesterov=True,
    )


def learning_rate(step: int, total_steps: int, config: TrainConfig) -> float:
    """Step `step`'s (0-based) learning rate: linear warm-up over `--warmup-fraction` of all
    steps, then cosine down to zero at `total_steps`.

    A pure function of the step, written into the optimiser before each step (as llm_fsdp's), so
    a resumed run needs only its step, and a rerun that asks for more epochs stretches the curve
    instead of tripping a scheduler that had already finished (OneCycleLR would raise).
    """
    warmup = max(1, round(total_steps * config.warmup_fraction))
    if step < warmup:
        return config.lr * ((step + 1) / warmup)
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return config.lr * (0.5 * (1.0 + math.cos(math.pi * progress)))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group steps at `lr` (the two groups differ only in weight decay)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


# ---------------------------------------------------------------------------------------------
# One step, and the model it trains
# ---------------------------------------------------------------------------------------------


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    context: WorkerContext,
    *,
    lr: float,
    totals: EpochTotals,
) -> str:
    """One optimiser step at learning rate `lr` over this rank's rows (uint8 images, normalised on
    the model's device), in `grad_accum_steps` micro-batches; returns the dtype the forward pass
    computed in (bfloat16 when autocast is really in effect)."""
    config, device = context.config, totals.sums.device
    inputs = on_device(batch, context.info, device)
    images, labels = inputs["image"], inputs["label"]
    model.train()
    logits = torch.empty(0)
    batches = [
        {"image": part, "label": part_labels}
        for part, part_labels in zip(
            images.chunk(config.grad_accum_steps),
            labels.chunk(config.grad_accum_steps),
            strict=True,
        )
    ]
    for index, batch in enumerate(batches):
        # Between micro-batches, gradients stay local; DDP all-reduces once per optimiser step.
        last = index == len(batches) - 1
        no_sync = getattr(model, "no_sync", None)
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            with autocast(batch["image"].device, config.bf16):
                logits = model(batch["image"])
                loss = loss_fn(logits, batch["label"])
            (loss / len(batches)).backward()
        totals.add(logits, loss, batch["label"])
    if config.grad_clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
    set_learning_rate(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return str(logits.dtype).removeprefix("torch.")


def build_training(
    info: DatasetInfo, config: TrainConfig
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (seeded, then moved to the device and wrapped in DDP by Ray) and its optimiser."""
    torch.manual_seed(config.seed)
    model = build_model(info.num_classes, info.channels, config.model_width)
    model = ray.train.torch.prepare_model(model)  # moves to the device, wraps in DDP if world > 1
    return model, build_optimizer(model, config)


# ---------------------------------------------------------------------------------------------
# The per-worker loop
# ---------------------------------------------------------------------------------------------


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every worker: build → restore → for each batch of this worker's shard: step, log,
    maybe validate, maybe checkpoint → finish. When to log, validate and checkpoint, and what a
    checkpoint holds, are the components' (MetricsLogger, Validator, Checkpointer, above); which
    rows an epoch reads, so that each is trained once per epoch, is TrainingRows' (the library's
    `raytrain_common.ingest`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    context = WorkerContext.parse(loop_config)  # the typed config, the dataset, the epoch's size
    config, info = context.config, context.info
    quiet_ray_output(config.verbose)
    clock = StartupClock(loop_config["startup"])  # the driver's phases; rank 0 adds the rest
    clock.mark("worker_group")

    model, optimizer = build_training(info, config)
    run = RunState()  # the run's counters and history
    rows = TrainingRows(  # the epoch's rows: which the epoch reads, each trained once
        context.run_dir,
        context.rank,
        context.train_rows,
        context.steps,
        config.global_batch_size,
        config.record_row_ids,
    )
    logger = MetricsLogger(context, run, clock)  # its EpochTotals: the epoch's metric sums
    validator = Validator(model, context)
    checkpointer = Checkpointer(
        context,
        model=model,
        optimizer=optimizer,
        run=run,
        rows=rows,
        epoch_sums=logger.totals,
        logger=logger,
    )
    # Resume from this run's newest complete checkpoint, if any (a restarted worker group, a rerun).
    checkpointer.restore(resume_checkpoint(ray.train.get_checkpoint(), context.run_dir))
    clock.mark("model_build")
    try:
        for epoch in checkpointer.epochs_left():
            # A resumed epoch reads only the rows it has not trained; a new one all, in a new order.
            shard = ray.train.get_dataset_shard(rows.dataset())
            batches = shard.iter_torch_batches(
                batch_size=context.rows_per_step,
                drop_last=True,  # every rank takes the same number of steps
                collate_fn=TrainingBatch(),  # uint8 on the CPU (on_device moves it), skipped files
                local_shuffle_buffer_size=loop_config["local_shuffle_rows"],
                local_shuffle_seed=epoch_seed(config.seed + context.rank, epoch),
            )
            for batch in logger.timed(rows.counted(batches, epoch, run.step)):
                lr = learning_rate(run.step, context.last_step, config)
                totals = logger.totals  # the epoch's sums, which the step adds to
                run.compute_dtype = train_step(
                    model, optimizer, batch, context, lr=lr, totals=totals
                )
                run.step += 1
                logger.step_end(run, lr=lr)
                # No logger.record (llm-fsdp's): the epoch's row, with its validation, is written
                # at the epoch's checkpoint.
                validation = validator.maybe_validate(run.step)  # a collective at epoch ends
                # Every other collective of the step: the preemption check, and at a checkpoint
                # the epoch's sums and rows over the ranks.
                if checkpointer.step_end(validation):
                    return
    finally:
        logger.close()


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def decoded_side(info: DatasetInfo, image_size: int | None) -> DatasetInfo:
    """The dataset as this run decodes it: an RGB image tree at --image-size when given (its files
    are decoded from the originals every epoch, so any side needs no new prepare); the checkpoint
    records it, so validation, test and predict decode at the side the model trained on."""
    if image_size is None or not info.decodes_files or info.channels != 3:
        return info
    return dataclasses.replace(info, height=image_size, width=image_size)


def check_run(config: TrainConfig) -> tuple[TrainConfig, DatasetInfo, StoragePath, int]:
    """Everything that can be checked before Ray starts: the options, the storage, the prepared
    data, and that a resume finds the same data and model width. The config comes back with its
    paths resolved, with the dataset as this run decodes it and the optimiser steps per epoch."""
    storage, data_dir = locate_run(config)
    info = decoded_side(inspect_dataset(data_dir, PREPARE_COMMAND), config.image_size)
    train_rows = training_rows(info, config)
    steps = steps_per_epoch(train_rows, config.global_batch_size)
    if steps < 1:
        raise ConfigError(
            f"{train_rows} training rows make no full global batch of {config.global_batch_size}: "
            "use more rows or a smaller --global-batch-size"
        )
    augmentation = config.resolved_augment(info.decodes_files, info.channels)
    if config.reproducible and augmentation != "none":
        raise ConfigError(
            f"--reproducible with --augment {augmentation}: its random crops differ in every run; "
            "add --augment none, or drop --reproducible"
        )
    width = {"--model-width": (config.model_width, 64)}  # 64: before checkpoints saved it
    check_resumable(storage.join(config.run_name), info.fingerprint, info.train_rows, width)
    log.info(
        "training %s on %d worker(s) for %d epoch(s); run folder %s",
        *(config.run_name, config.num_workers, config.epochs, storage.join(config.run_name)),
    )
    config = dataclasses.replace(
        config, storage_path=storage.uri, data_dir=data_dir.uri, augment=augmentation
    )
    return config, info, storage, steps


def image_data(config: TrainConfig, info: DatasetInfo, run_dir: StoragePath) -> ImageData:
    """Ray Data reads, shuffles and decodes the images on the cluster's CPUs (the library's
    ImageData), then augments them (transforms.py). Ray calls its factories at every worker-group
    start, so a restart reads from the newest checkpoint's place in the epoch."""
    return ImageData(
        data_dir=config.resolved_data_dir(),
        info=dataclasses.asdict(info),
        run_dir=run_dir.uri,
        seed=config.seed,
        crop_scale=config.crop_scale if config.augment == "photo" else None,  # while decoding
        augment=augment if config.augment in ("crop", "crop-flip") else None,
        augment_kwargs={"pad": max(1, info.height // 8), "flip": config.augment == "crop-flip"},
        limit_train_rows=config.limit_train_rows,
        limit_val_rows=config.limit_val_rows,
        progress_bars=config.verbose,
    )


def run(
    config: TrainConfig, callbacks: Sequence[UserCallback] = (), started_at: float | None = None
) -> dict[str, Any]:
    """Check, train, write curves and summary.json. `callbacks` join the run's (a sweep passes
    Tune's); `started_at`: when the command started (time.time()), where start-up counts from."""
    clock = StartupClock(started_at)  # summary.json's startup_s, phase by phase
    config, info, storage, steps = check_run(config)
    if not callbacks and (finished := finished_run_summary(config, storage, steps)):
        return finished  # a sweep's trial always trains: Tune awaits its reports
    ingest = node_labels(config.ingest_node_labels, "--ingest-node-labels")
    ingest_has_cpus = partial(check_cpus_for_ingest, ingest, config.needed_resources()["CPU"])
    started = start_run(config, storage, run_inputs(config, info), clock, [ingest_has_cpus])
    data = image_data(config, info, started.run_dir)
    watch = IngestNodeWatch(ingest, config.ingest_wait_s, started.run_dir)  # ingest nodes lost
    trainer = TorchTrainer(
        train_loop_per_worker,
        datasets={TRAIN: data.train, REST_OF_EPOCH: data.rest_of_epoch, VAL: data.val},
        dataset_config=EvenTrainingEveryValidationRow(ingest, config.reproducible),  # on `ingest`
        train_loop_config=started.loop_config(
            config, dataset=info, local_shuffle_rows=data.local_shuffle_rows
        ),
        scaling_config=build_scaling_config(config),
        run_config=build_run_config(config, score_attribute=SCORE, callbacks=callbacks),
        torch_config=build_torch_config(config),
        validation_config=async_validation(config, started.run_dir),  # None: inline, in the loop
    )
    with started.failures_named(config.storage_path), watch:
        result = trainer.fit()  # the workers train; it returns when the run has ended
        summary = write_run_outputs(started.run_dir, result, config, info, steps, clock.began)
    return started.finish(summary)


def run_inputs(config: TrainConfig, info: DatasetInfo) -> dict[str, StoragePath]:
    """What every node's tasks read, so start_run refuses node-local copies on a cluster."""
    inputs = {"the data folder (--data-dir)": resolve_storage(config.resolved_data_dir())}
    if info.image_root:  # the files themselves, which every node's decode tasks read
        inputs["the image tree (prepare --source)"] = resolve_storage(info.image_root)
    return inputs
