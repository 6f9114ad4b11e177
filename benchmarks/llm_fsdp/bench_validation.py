"""Benchmark: training steps/s with inline validation ÷ with `--validation async`, same blocks,
same cores, runs alternated in one process tree (one local Ray cluster).

Both validate at the same steps: inline every --eval-every-steps, async each checkpoint, with
--checkpoint-every-steps equal to it. Steps/s counts the steps between the first checkpoint's
report and the last one's (a UserCallback in Ray Train's controller notes when each arrives):
start-up, compilation and the first window's warm-up, the test split and the wait for the last
async validation are left out; inline validation's stall is in, and so is what an async task
takes from the training workers' cores. On a CPU-only box the task shares the training workers'
CPUs; on GPUs it would take a GPU or CPUs of its own (--validation-gpus / --validation-cpus).

    python -m benchmarks.llm_fsdp.bench_validation [--rounds 2] [--steps 60] [--every 10]
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

from llm_fsdp.cli import USER_ERRORS
from llm_fsdp.config import PRESETS, TrainConfig
from llm_fsdp.train import run


class ReportClock(UserCallback):
    """Appends each checkpoint's arrival time to a file (the callback runs in Ray Train's
    controller, a process of its own, so it hands its times over through the file system)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def after_report(
        self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None
    ) -> None:
        if checkpoint is not None and metrics:
            with open(self.path, "a", encoding="utf-8") as stream:
                stream.write(json.dumps({"step": metrics[0]["step"], "at": time.time()}) + "\n")


def steps_per_s(
    config: TrainConfig, validation: Literal["inline", "async"], name: str, folder: Path
) -> dict[str, Any]:
    """One run with `validation`; its steps/s between the first and the last checkpoint."""
    clock = folder / f"{name}.reports.jsonl"
    summary = run(
        dataclasses.replace(config, run_name=name, validation=validation),
        callbacks=[ReportClock(str(clock))],
    )
    reports = [json.loads(line) for line in clock.read_text().splitlines()]
    rate = (reports[-1]["step"] - reports[0]["step"]) / (reports[-1]["at"] - reports[0]["at"])
    return {
        "validation": validation,
        "steps_per_s": rate,
        "best": summary["best"]["val_loss"],
        "wall_s": summary["wall_time_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llm_fsdp.bench_validation")
    parser.add_argument("--rounds", type=int, default=2, help="inline/async pairs, alternated")
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--every", type=int, default=10, help="validate (and checkpoint) every N")
    parser.add_argument("--storage-path", default=None, help="runs go here (default: a temp dir)")
    parser.add_argument(
        "--data-dir", default=PRESETS["cpu"].resolved_data_dir(), help="prepared corpus (prepare's)"
    )
    args = parser.parse_args(argv)
    try:
        return measure(args)
    except USER_ERRORS as error:
        print(f"python -m benchmarks.llm_fsdp.bench_validation: error: {error}", file=sys.stderr)
        return 2


def measure(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-validation-") as scratch:
        folder = Path(args.storage_path or scratch)
        config = dataclasses.replace(
            PRESETS["cpu"],
            storage_path=str(folder),
            data_dir=args.data_dir,
            max_steps=args.steps,
            eval_every_steps=args.every,
            checkpoint_every_steps=args.every,
            tracking="none",
        )
        results = [
            steps_per_s(config, validation, f"{validation}-{round_}-{time.time_ns()}", folder)
            for round_ in range(args.rounds)
            for validation in ("inline", "async")
        ]
    for result in results:
        print(
            f"{result['validation']:>6}: {result['steps_per_s']:.3f} steps/s, best val loss "
            f"{result['best']:.4f}, run {result['wall_s']:.0f} s"
        )
    rate = {
        mode: statistics.median(r["steps_per_s"] for r in results if r["validation"] == mode)
        for mode in ("inline", "async")
    }
    print(
        f"training steps/s, async ÷ inline validation: {rate['async'] / rate['inline']:.3f} "
        f"({rate['async']:.3f} ÷ {rate['inline']:.3f}; medians of {args.rounds} round(s), "
        f"{args.steps} steps validated every {args.every})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
