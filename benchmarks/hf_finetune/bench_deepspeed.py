"""Benchmark: DeepSpeed ZeRO-2, ZeRO-3 with the optimiser offloaded, and LoRA, each ÷ plain DDP,
through the pipeline's `run()` (the Hugging Face Trainer in Ray Train workers), same sentences,
same seed, same steps, same cores, in one process tree.

Printed for each mode: sentences/s (the steady rate of the progress lines after the first), the
training workers' peak resident memory, the bytes of the last checkpoint, the last step's training
loss and the largest relative difference of any step's loss from DDP's (the same seed's curve), and
the validation loss after the steps; then each ÷ DDP. On 2 CPU workers (gloo) by default; `--gpu`
takes the gpu preset's settings on one GPU per worker.

    python -m benchmarks.hf_finetune.bench_deepspeed [--rows 1024] [--data-dir …]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from hf_finetune.cli import USER_ERRORS
from hf_finetune.config import PRESETS, TrainConfig
from hf_finetune.train import run

MODES: dict[str, dict[str, Any]] = {
    "ddp": {},
    "zero2": {"deepspeed": "zero2"},
    "zero3+offload": {"deepspeed": "zero3", "offload": "optimizer"},
    "lora r8": {"lora_rank": 8, "lr": 1e-3},
}
FIGURES = (
    ("sentences_per_s", "sentences/s", "{:,.0f}"),
    ("worker_peak_rss_mb", "worker peak RSS (MiB)", "{:,.0f}"),
    ("checkpoint_mb", "checkpoint (MB)", "{:,.1f}"),
    ("last_loss", "last step's loss", "{:.4f}"),
    ("val_loss", "val_loss after the steps", "{:.4f}"),
)


def step_losses(latest_checkpoint: str) -> dict[int, float]:
    state = json.loads((Path(latest_checkpoint) / "trainer_state.json").read_text())
    return {row["step"]: row["loss"] for row in state["log_history"] if "loss" in row}


def one_run(config: TrainConfig) -> dict[str, Any]:
    summary = run(config)
    latest = Path(summary["latest_checkpoint"])
    losses = step_losses(summary["latest_checkpoint"])
    return {
        "sentences_per_s": summary["sentences_per_s"],
        "worker_peak_rss_mb": summary["worker_peak_rss_mb"],
        "checkpoint_mb": sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()) / 1e6,
        "last_loss": losses[max(losses)],
        "val_loss": summary["final"]["val_loss"],
        "losses": losses,
    }


def bench_config(args: argparse.Namespace, storage: str) -> TrainConfig:
    return dataclasses.replace(
        PRESETS["gpu" if args.gpu else "cpu"],
        storage_path=storage,
        data_dir=args.data_dir,
        epochs=1,
        limit_train_rows=args.rows,
        limit_val_rows=256,
        limit_test_rows=256,
        global_batch_size=args.batch,
        log_every_steps=1,
        tracking="none",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_finetune.bench_deepspeed")
    parser.add_argument("--rows", type=int, default=1024, help="training sentences (one epoch)")
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--data-dir", default="runs/data/text_classification")
    parser.add_argument("--gpu", action="store_true", help="the gpu preset's settings")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-deepspeed-") as storage:
            config = bench_config(args, storage)
            for mode, changes in MODES.items():
                name = mode.replace(" ", "-").replace("+", "-")
                results[mode] = one_run(dataclasses.replace(config, run_name=name, **changes))
    except USER_ERRORS as error:
        print(f"python -m benchmarks.hf_finetune.bench_deepspeed: error: {error}", file=sys.stderr)
        return 2
    ddp = results["ddp"]
    for result in results.values():
        result["loss_gap"] = max(
            abs(loss - ddp["losses"][step]) / ddp["losses"][step]
            for step, loss in result["losses"].items()
        )
    steps = len(ddp["losses"])
    print(f"MiniLM-L6 on VADER, {steps} steps of {args.batch} sentences, same seed")
    print(f"{'':30}" + "".join(f"{mode:>15}" for mode in results))
    for key, label, form in (*FIGURES, ("loss_gap", "largest step-loss gap to DDP", "{:.2%}")):
        print(f"{label:30}" + "".join(f"{form.format(r[key]):>15}" for r in results.values()))
    for key, label, _ in FIGURES[:3]:
        ratios = "".join(f"{r[key] / ddp[key]:>15.3f}" for r in results.values())
        print(f"{label + ' ÷ DDP':30}{ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
