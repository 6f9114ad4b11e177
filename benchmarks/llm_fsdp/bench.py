"""Training tokens/s of the pipeline (FSDP2 on Ray Train) ÷ one plain process, same model and data.

On a GPU machine it measures the `gpu` preset (SmolLM2-135M, bf16, compiled, micro-batch 64 × 1024)
with one worker per GPU and prints MFU and peak memory beside each figure; elsewhere the `cpu`
preset (the tiny model) with 2 workers on the CPU cores. Both runs take the same steps over the same
blocks with the preset's learning rate, after warm-up steps that hold the compilation; Ray's
start-up is left out (it is paid once per job).

    python -m benchmarks.llm_fsdp.bench [--preset gpu] [--steps 30] [--warm-up 5] [--workers N]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from llm_fsdp.cli import USER_ERRORS
from llm_fsdp.config import PRESETS, TrainConfig
from llm_fsdp.model import resolve_model
from llm_fsdp.parallelize import compile_model
from llm_fsdp.task import build_model, model_flops_per_token
from llm_fsdp.train import (
    build_optimizer,
    dataset_info,
    learning_rate,
    run,
    stage_blocks,
    take_blocks,
)
from raytrain_common.configs import per_worker_batch_size
from raytrain_common.hardware import mfu, peak_memory_gb
from raytrain_common.metrics import read_metrics_csv, write_metrics_csv
from raytrain_common.storage import resolve_storage
from raytrain_common.tokens.corpus import split_blocks
from raytrain_common.tokens.order import global_batch_indices

log = logging.getLogger("benchmarks.llm_fsdp.bench")
RUN_NAME = "bench_llm"


def single_process(config: TrainConfig, steps: int, warm_up: int) -> dict[str, Any]:
    """The same steps in one process without Ray or FSDP: the model on this machine's device (every
    CPU core through torch's threads), bf16 by autocast where the preset asks for it."""
    storage = resolve_storage(config.storage_path)
    data_dir = resolve_storage(config.resolved_data_dir())
    info = dataset_info(config)
    device = torch.device("cuda" if config.use_gpu else "cpu")
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(config.seed)
    spec = resolve_model(config.model, storage.path if storage.is_local else "")
    model = build_model(spec, info, config.loss_chunk_tokens).to(device)
    if config.compile:
        compile_model(model)
    optimizer = build_optimizer(model, config)
    blocks = stage_blocks(split_blocks(data_dir, "train", info), device)
    micro = per_worker_batch_size(config.global_batch_size, 1, config.grad_accum_steps)
    tokens_per_micro = micro * info.seq_len
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if config.bf16
        else contextlib.nullcontext()
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for step in range(warm_up + steps):
        if step == warm_up:
            _synchronize(device)
            started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        indices = global_batch_indices(step, config.global_batch_size, len(blocks), config.seed)
        for part in np.split(indices, config.grad_accum_steps):
            with autocast:
                loss_sum = model(take_blocks(blocks, part, device))
            (loss_sum / (tokens_per_micro * config.grad_accum_steps)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    tokens_per_s = steps * config.global_batch_size * info.seq_len / (time.perf_counter() - started)
    per_token = model_flops_per_token(model, info.seq_len)
    result = {
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s * per_token, device),
        "peak_memory_gb": peak_memory_gb(device),
    }
    del model, optimizer, blocks
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the pipeline's worker needs this GPU next
    return result


def pipeline(config: TrainConfig, warm_up: int) -> dict[str, Any]:
    """Steady-state figures of the pipeline itself, from its metrics windows after the warm-up."""
    summary = run(config)
    rows = [
        r
        for r in read_metrics_csv(resolve_storage(summary["metrics_csv"]))
        if "tokens_per_s" in r and r["step"] > warm_up
    ]
    return {
        "tokens_per_s": float(np.mean([r["tokens_per_s"] for r in rows])),
        "mfu": float(np.mean([r["mfu"] for r in rows])) if "mfu" in rows[0] else None,
        "peak_memory_gb": summary["peak_memory_gb"],
    }


def checkpoint_stalls(config: TrainConfig, steps: int, every: int) -> dict[str, float | None]:
    """Seconds training waits per checkpoint, median, with the upload to storage in the step
    (sync) and in the background (async): two short runs of the pipeline, a checkpoint every
    `every` steps, nothing else in between."""
    stalls: dict[str, float | None] = {}
    for mode, async_upload in (("sync", False), ("async", True)):
        run_name = f"{RUN_NAME}_checkpoint_{mode}"
        run_dir = resolve_storage(config.storage_path).join(run_name)
        if run_dir.is_dir():
            run_dir.filesystem.delete_dir(run_dir.path)
        summary = run(
            dataclasses.replace(
                config,
                run_name=run_name,
                max_steps=steps,
                warmup_steps=min(config.warmup_steps, steps - 1),
                eval_every_steps=steps,
                checkpoint_every_steps=every,
                async_upload=async_upload,
            )
        )
        stalls[mode] = summary["checkpoint_stall_s"]
    return stalls


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_config(args: argparse.Namespace) -> TrainConfig:
    """The preset, shortened to warm-up + steps (no evaluation or checkpoint in between)."""
    preset = PRESETS[args.preset]
    total = args.warm_up + args.steps
    return dataclasses.replace(
        preset,
        storage_path=args.storage_path,
        data_dir=args.data_dir,
        run_name=RUN_NAME,
        model=args.model or preset.model,
        num_workers=args.workers or (torch.cuda.device_count() if preset.use_gpu else 2),
        epochs=None,
        max_steps=total,
        warmup_steps=min(preset.warmup_steps, total - 1),
        log_every_steps=args.warm_up,
        eval_every_steps=total,
        checkpoint_every_steps=total,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.llm_fsdp.bench", description=__doc__
    )
    default_preset = "gpu" if torch.cuda.is_available() else "cpu"
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=default_preset,
        help=f"(default here: {default_preset})",
    )
    parser.add_argument("--storage-path", default="./runs", help="(default: ./runs)")
    parser.add_argument(
        "--data-dir", default=None, help="(default: the preset's, under the storage path)"
    )
    parser.add_argument("--model", default=None, help="as `train --model` (default: the preset's)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (default: 30)")
    parser.add_argument("--warm-up", type=int, default=5, help="steps before timing (default: 5)")
    parser.add_argument(
        "--workers", type=int, default=None, help="(default: 1 per GPU, or 2 on CPU)"
    )
    parser.add_argument(
        "--checkpoint-steps",
        type=int,
        default=20,
        help="steps of each checkpoint-stall run, a checkpoint every 5 (default: 20; 0: skip)",
    )
    args = parser.parse_args(argv)
    try:
        return measure(args)
    except USER_ERRORS as error:
        print(f"python -m benchmarks.llm_fsdp.bench: error: {error}", file=sys.stderr)
        return 2


def measure(args: argparse.Namespace) -> int:
    config = bench_config(args)
    run_dir = resolve_storage(config.storage_path).join(RUN_NAME)
    if run_dir.is_dir():  # a benchmark measures a fresh run, never a resumed one
        run_dir.filesystem.delete_dir(run_dir.path)

    single = single_process(config, args.steps, args.warm_up)
    fsdp = pipeline(config, args.warm_up)
    ratio = fsdp["tokens_per_s"] / single["tokens_per_s"]
    rows = [
        {"run": "single process", "workers": 1, **single},
        {"run": "FSDP2 on Ray Train", "workers": config.num_workers, **fsdp},
    ]
    csv_file = resolve_storage(args.storage_path).join("bench", "bench_llm.csv")
    device = torch.cuda.get_device_name(0) if config.use_gpu else f"{os.cpu_count()} CPU cores"
    print(
        f"\n{config.model} ({args.preset} preset), {args.steps} "
        f"steps after {args.warm_up} warm-up, {device}"
    )
    print("| run | workers | tokens/s | MFU | peak memory GiB |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        memory = f"{row['peak_memory_gb']:.1f}" if row["peak_memory_gb"] is not None else "-"
        print(
            f"| {row['run']} | {row['workers']} | {row['tokens_per_s']:,.0f} | {mfu} | {memory} |"
        )
    print(f"ratio (FSDP2 on Ray Train ÷ single process, tokens/s): {ratio:.3f}   target ≥ 0.9")
    if args.checkpoint_steps:
        stalls = checkpoint_stalls(config, args.checkpoint_steps, every=5)
        rows.append({"run": "checkpoint, sync upload", "checkpoint_stall_s": stalls["sync"]})
        rows.append({"run": "checkpoint, async upload", "checkpoint_stall_s": stalls["async"]})
        print(
            "training stalled per checkpoint (median, every 5 steps, storage "
            f"{config.storage_path}): sync upload {stalls['sync']:.3f} s, "
            f"async upload {stalls['async']:.3f} s"
        )
    write_metrics_csv(csv_file, [*rows, {"run": "ratio", "tokens_per_s": ratio}])
    print(f"written to {csv_file.uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
