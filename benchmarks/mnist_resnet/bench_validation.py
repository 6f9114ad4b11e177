"""Benchmark: training steps/s with inline validation ÷ with `--validation async`, same rows, same
cores, runs alternated in one process tree (one local Ray cluster).

Steps/s counts the epochs after the first, between their checkpoints' reports (a UserCallback in
Ray Train's controller notes when each arrives): start-up, the first epoch's warm-up, the test split
and the wait for the last async validation are left out; inline validation's stall at each epoch's
end is in (it comes before the report), and so is what an async validation task takes from the
training workers' cores. On a CPU-only box the task shares the training workers' CPUs; on GPUs it
would take a GPU or CPUs of its own (--validation-gpus / --validation-cpus).

    python -m benchmarks.mnist_resnet.bench_validation [--rounds 2] [--epochs 4] [--rows 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from ray.train import Checkpoint, UserCallback

from mnist_resnet.cli import USER_ERRORS
from mnist_resnet.config import PRESETS, TrainConfig
from mnist_resnet.train import run
from raytrain_common.metrics import read_metrics_csv
from raytrain_common.storage import resolve_storage


class ReportClock(UserCallback):
    """Appends each epoch checkpoint's arrival time to a file (the callback runs in Ray Train's
    controller, a process of its own, so it hands its times over through the file system)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def after_report(
        self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None
    ) -> None:
        if checkpoint is not None and metrics and float(metrics[0]["epoch"]).is_integer():
            with open(self.path, "a", encoding="utf-8") as stream:
                stream.write(json.dumps({"epoch": metrics[0]["epoch"], "at": time.time()}) + "\n")


def steps_per_s(
    config: TrainConfig, validation: Literal["inline", "async"], name: str, folder: Path
) -> dict[str, Any]:
    """One run with `validation`; its steps/s over the epochs after the first."""
    clock = folder / f"{name}.reports.jsonl"
    summary = run(
        dataclasses.replace(config, run_name=name, validation=validation),
        callbacks=[ReportClock(str(clock))],
    )
    arrivals = [json.loads(line)["at"] for line in clock.read_text().splitlines()]
    steps_per_epoch = summary["steps_done"] // config.epochs
    rate = steps_per_epoch * (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    rows = read_metrics_csv(resolve_storage(summary["metrics_csv"]))
    return {
        "validation": validation,
        "steps_per_s": rate,
        "val_s": statistics.median(row["val_s"] for row in rows),
        "best": summary["best"]["val_accuracy"],
        "wall_s": summary["wall_time_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mnist_resnet.bench_validation")
    parser.add_argument("--rounds", type=int, default=2, help="inline/async pairs, alternated")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (≥ 3)")
    parser.add_argument("--rows", type=int, default=4096, help="training rows per epoch")
    parser.add_argument("--storage-path", default=None, help="runs go here (default: a temp dir)")
    parser.add_argument(
        "--data-dir", default=PRESETS["cpu"].resolved_data_dir(), help="prepared MNIST (prepare's)"
    )
    args = parser.parse_args(argv)
    try:
        return measure(args)
    except USER_ERRORS as error:
        print(
            f"python -m benchmarks.mnist_resnet.bench_validation: error: {error}", file=sys.stderr
        )
        return 2


def measure(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-validation-") as scratch:
        folder = Path(args.storage_path or scratch)
        config = dataclasses.replace(
            PRESETS["cpu"],
            storage_path=str(folder),
            data_dir=args.data_dir,
            epochs=args.epochs,
            limit_train_rows=args.rows,
            limit_test_rows=1000,
            tracking="none",
        )
        results = [
            steps_per_s(config, validation, f"{validation}-{round_}-{time.time_ns()}", folder)
            for round_ in range(args.rounds)
            for validation in ("inline", "async")
        ]
    for result in results:
        print(
            f"{result['validation']:>6}: {result['steps_per_s']:.3f} steps/s, validation "
            f"{result['val_s']:.1f} s per epoch, best val accuracy {result['best']:.4f}, "
            f"run {result['wall_s']:.0f} s"
        )
    rate = {
        mode: statistics.median(r["steps_per_s"] for r in results if r["validation"] == mode)
        for mode in ("inline", "async")
    }
    print(
        f"training steps/s, async ÷ inline validation: {rate['async'] / rate['inline']:.3f} "
        f"({rate['async']:.3f} ÷ {rate['inline']:.3f}; medians of {args.rounds} round(s), "
        f"{args.epochs} epochs of {args.rows} rows, the whole validation split)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
