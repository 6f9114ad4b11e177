"""The edit-run loop: seconds from `train`'s start to its first optimiser step, cold and attached to
a running cluster, each against Ray Train's own floor measured in the same run.

    nox -s bench_first_step      (or: python tools/bench_first_step.py [--pipelines ...])

For every pipeline: its data prepared once (not timed); then the floor (`bench_ray_train_floor`:
imports, a local cluster's start, an empty 2-worker TorchTrainer reaching its function); a cold
`train` (its own local cluster, as a first run has); then, with a cluster started by
`raytrain_common.local_cluster start` (what `nox -s cluster` runs) and the variables it prints,
two attached `train` runs (the second is the edit-run loop's: the cluster's workers warm). Each
figure is the run's own `startup_s` from summary.json: from the process's start to the first
optimiser step. The runs are small but real (the default presets, a few steps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each pipeline's few-step train, which still validates and checkpoints (its data: `prepare`'s
# defaults).
PIPELINES: dict[str, list[str]] = {
    "mnist_resnet": [
        *("--model-width", "16", "--global-batch-size", "128", "--stop-at-step", "2"),
        *("--limit-train-rows", "1024", "--limit-val-rows", "256", "--limit-test-rows", "256"),
    ],
    "llm_fsdp": [
        *("--max-steps", "3", "--warmup-steps", "1", "--eval-every-steps", "3"),
        *("--checkpoint-every-steps", "3", "--eval-batches", "1", "--test-blocks", "16"),
    ],
    "hf_finetune": [
        *("--limit-train-rows", "256", "--limit-val-rows", "64", "--limit-test-rows", "64"),
        *("--stop-at-step", "2"),
    ],
}


def command(pipeline: str, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", pipeline, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{pipeline} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def first_step_s(pipeline: str, storage: Path, name: str, env: dict[str, str]) -> float:
    """One small `train` run; its summary's startup_s."""
    flags = PIPELINES[pipeline]
    command(pipeline, "train", "--storage-path", str(storage), "--run-name", name, *flags, env=env)
    summary = json.loads((storage / name / "summary.json").read_text())
    return float(summary["startup_s"])


def floor_s(env: dict[str, str]) -> float:
    """Ray Train's floor, as `bench_ray_train_floor` prints it: imports + the local cluster's start
    + fit() to an empty function's first line."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_ray_train_floor.py"), "--runs", "1"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    numbers = re.findall(r"(?:imports|start|first line) ([\d.]+) s", done.stdout)
    return sum(float(number) for number in numbers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", nargs="*", default=list(PIPELINES), choices=PIPELINES)
    args = parser.parse_args()
    from raytrain_common.local_cluster import start, stop

    cold_env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    with tempfile.TemporaryDirectory(prefix="bench-first-step-") as scratch:
        storage = Path(scratch) / "runs"
        for pipeline in args.pipelines:
            command(pipeline, "prepare", "--storage-path", str(storage), env=cold_env)
        floor = floor_s(cold_env)
        cold = {
            name: first_step_s(name, storage, f"{name}-cold", cold_env) for name in args.pipelines
        }
        cluster = Path(scratch) / "cluster"
        attached_env = {**cold_env, **start(cluster)}
        try:
            attached = {
                name: [first_step_s(name, storage, f"{name}-{i}", attached_env) for i in (1, 2)]
                for name in args.pipelines
            }
        finally:
            stop(cluster)
    print(f"Ray Train's floor (cold, 2 workers, nothing to train): {floor:.1f} s")
    print("pipeline       cold   cold - floor   attached (1st)   attached (2nd)")
    for name in args.pipelines:
        first, second = attached[name]
        gap = cold[name] - floor
        print(f"{name:<13} {cold[name]:5.1f}   {gap:+10.1f}   {first:12.1f}   {second:14.1f}")


if __name__ == "__main__":
    main()
