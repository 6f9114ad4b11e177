"""The same model, data and hyperparameters in plain single-process PyTorch, for comparison.

No Ray, no DDP: the whole training split is decoded into memory once, then batches of
`global_batch_size` are normalised on the fly exactly as the Ray pipeline does.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mnist_resnet.config import TrainConfig
from mnist_resnet.predict import predict_labels
from mnist_resnet.run_state import steps_per_epoch
from mnist_resnet.task import as_nchw, autocast, build_model, loss_fn, normalise
from mnist_resnet.train import (
    THROUGHPUT_SKIP_STEPS,
    build_optimizer,
    learning_rate,
    set_learning_rate,
)
from raytrain_common.hardware import peak_memory_gb
from raytrain_common.images.dataset import inspect_dataset
from raytrain_common.images.stream import read_split_arrays
from raytrain_common.storage import resolve_storage

log = logging.getLogger("benchmarks.mnist_resnet.baseline")


def run_baseline(config: TrainConfig) -> dict[str, Any]:
    """Train in this process; return per-epoch metrics and steady-state images/s."""
    config.validate()
    data_dir = resolve_storage(config.resolved_data_dir())
    info = inspect_dataset(data_dir)
    torch.manual_seed(config.seed)
    device = torch.device("cuda" if config.use_gpu and torch.cuda.is_available() else "cpu")
    train = read_split_arrays(data_dir, "train", config.limit_train_rows)
    val = read_split_arrays(data_dir, "val", config.limit_val_rows)
    train_images = as_nchw(train.images)
    train_labels = torch.from_numpy(train.labels)
    steps = steps_per_epoch(len(train_labels), config.global_batch_size)

    model = build_model(info.num_classes, info.channels, config.model_width).to(device)
    optimizer = build_optimizer(model, config)
    history = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for epoch in range(1, config.epochs + 1):
        model.train()
        order = torch.randperm(len(train_labels))
        started = steady_start = time.perf_counter()
        for step in range(1, steps + 1):
            index = order[(step - 1) * config.global_batch_size : step * config.global_batch_size]
            images = normalise(train_images[index], info.mean, info.std).to(device)
            labels = train_labels[index].to(device)
            with autocast(device, config.bf16):
                loss = loss_fn(model(images), labels)
            loss.backward()
            if config.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
            global_step = (epoch - 1) * steps + step - 1  # 0-based, over all epochs
            set_learning_rate(optimizer, learning_rate(global_step, steps * config.epochs, config))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == THROUGHPUT_SKIP_STEPS:
                steady_start = time.perf_counter()
            if step % config.log_every_steps == 0 or step == steps:
                log.info("epoch %d step %d/%d  loss %.4f", epoch, step, steps, loss.item())
        elapsed = time.perf_counter() - started
        steady_steps = steps - THROUGHPUT_SKIP_STEPS
        rate = (
            config.global_batch_size * steady_steps / (time.perf_counter() - steady_start)
            if steady_steps > 0
            else config.global_batch_size * steps / elapsed
        )
        accuracy = float((predict_labels(model, val.images, info, device) == val.labels).mean())
        row = {
            "epoch": epoch,
            "val_accuracy": accuracy,
            "train_images_per_s": rate,
            "train_s": elapsed,
        }
        if (memory := peak_memory_gb(device)) is not None:  # on a GPU
            row["peak_memory_gb"] = memory
        history.append(row)
        log.info("epoch %d  val accuracy %.4f  %.0f img/s", epoch, accuracy, rate)
    return {"history": history, "threads": torch.get_num_threads(), "device": str(device)}


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.mnist_resnet.baseline [train flags]`: the plain run, its metrics as
    JSON (what `mnist-resnet baseline` printed before it left the installed package)."""
    import argparse
    import json

    from mnist_resnet.config import PRESETS
    from raytrain_common.cli import add_config_options, config_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mnist_resnet.baseline")
    add_config_options(parser, TrainConfig, PRESETS)
    result = run_baseline(config_from_args(parser.parse_args(argv), TrainConfig, PRESETS))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
