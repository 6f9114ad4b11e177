"""`mnist-resnet sweep` for real: Ray Tune trials of real TorchTrainer runs, ASHA stopping the
lagging ones, MLflow runs nested under the sweep's, and a sweep killed midway that resumes when
rerun."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raytrain_common.storage import StoragePath
from raytrain_testkit.pace import paced

pytestmark = pytest.mark.ray


def sweep_command(storage: Path, data_dir: StoragePath) -> list[str]:
    """4 trials of one worker, two at a time, on 512 images for 2 epochs. The learning rates span
    four decades, so at the first rung (epoch 1) some trial lags the ones before it."""
    return [
        sys.executable,
        "-m",
        "mnist_resnet",
        "sweep",
        "--storage-path",
        str(storage),
        "--data-dir",
        data_dir.uri,
        "--sweep-name",
        "small",
        "--num-samples",
        "4",
        "--max-concurrent-trials",
        "2",
        "--limit-train-rows",
        "512",
        "--limit-val-rows",
        "256",
        "--limit-test-rows",
        "256",
        "--epochs",
        "2",
        "--batch-sizes",
        "128",
        "--lr-min",
        "1e-5",
        "--lr-max",
        "0.3",
        "--warmup-fractions",
        "0.1",
        "--weight-decays",
        "0.0005",
        "--log-every-steps",
        "4",
        "--model-width",
        "16",  # as every test's run: conftest's MODEL_WIDTH
    ]


def finished_trials(trials: Path) -> dict[str, str]:
    """Trial id → the time its summary.json was written (a trial writes it when it has trained)."""
    return {
        path.parent.name: json.loads(path.read_text())["written_at"]
        for path in trials.glob("*/summary.json")
    }


def test_a_sweep_stops_lagging_trials_resumes_after_a_kill_and_its_best_command_trains(
    mnist_dir: StoragePath, ray_address: str, tmp_path: Path
) -> None:
    """The sweep and the printed command run as a user runs them on a cluster of their own:
    joined through RAY_ADDRESS (the session's cluster), so no command starts a cluster."""
    storage = tmp_path / "runs"
    trials = storage / "sweeps" / "small" / "trials"
    command = sweep_command(storage, mnist_dir)
    env = {**os.environ, "RAY_ADDRESS": ray_address}

    # Killed (the driver, and with it the trials it owns) once a first trial has finished.
    first = subprocess.Popen(
        command,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    allowed_s = paced(400)
    deadline = time.monotonic() + allowed_s
    while not finished_trials(trials) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    assert first.poll() is None, "the sweep ended before it could be interrupted"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=paced(60))
    done_before = finished_trials(trials)
    assert done_before, f"no trial finished within {allowed_s:.0f} s"
    metrics_before = {trial: (trials / trial / "metrics.csv").read_text() for trial in done_before}

    rerun = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=paced(900), check=False
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "resuming sweep small" in rerun.stderr
    # ASHA starts again from the rungs it had (Tune restores the scheduler empty), which hold at
    # least the finished trials' first evaluations; by the end, every trial's first one.
    restored = re.search(r"ASHA: (\d+) evaluations of (\d+) trials from before", rerun.stderr)
    assert restored and int(restored[2]) >= 1, rerun.stderr[-3000:]
    rungs = json.loads((storage / "sweeps" / "small" / "scheduler" / "asha_rungs.json").read_text())
    first_rung = {milestone: recorded for milestone, recorded in rungs[0]}[1]
    assert len(first_rung) == 4, rungs
    # The trials that had finished were not trained again (Tune may not have saved their end
    # before the kill: the trial then hands Tune its evaluations from its run folder).
    done_after = finished_trials(trials)
    assert {trial: done_after[trial] for trial in done_before} == done_before
    for trial in done_before:
        assert metrics_before[trial] == (trials / trial / "metrics.csv").read_text()

    sweep_dir = storage / "sweeps" / "small"
    rows = read_metrics_csv_rows(sweep_dir / "results.csv")
    assert len(rows) == 4 and not any(row["error"] for row in rows)
    # One evaluation per epoch reached, though the finished trials reported theirs again on resume.
    assert all(float(row["evaluations"]) == float(row["epoch"]) for row in rows), rows
    assert any(row["stopped_early"] == "True" for row in rows), [  # ASHA stopped a trial
        {key: row[key] for key in ("trial_id", "lr", "epoch", "best_val_accuracy")} for row in rows
    ]
    assert (sweep_dir / "trials.png").stat().st_size > 10_000
    best = json.loads((sweep_dir / "best.json").read_text())
    finished = [row for row in rows if row["stopped_early"] == "False"]
    assert best["best_trial"] in {row["trial_id"] for row in finished}
    assert best["best_val_accuracy"] == pytest.approx(
        max(float(row["best_val_accuracy"]) for row in rows), abs=1e-6
    )
    assert f"train it in full:\n  {best['command']}" in rerun.stdout
    assert f"{sys.executable} -m mnist_resnet train --preset cpu" in rerun.stdout

    # One MLflow run per trial, nested under the sweep's run, in the store under the storage path.
    client = MlflowClient(f"sqlite:///{storage.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("mnist_resnet")
    runs = client.search_runs([experiment.experiment_id])
    parents = [run for run in runs if run.data.tags.get("sweep") == "parent"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(run.info.run_name for run in children) == sorted(row["trial_id"] for row in rows)
    assert all(client.get_metric_history(run.info.run_id, "val_accuracy") for run in children)

    # The printed command trains (cut to one epoch of a slice here: the flags after it win).
    words = shlex.split(best["command"])
    assert words[:4] == ["mnist-resnet", "train", "--preset", "cpu"]
    assert "--lr" in words and "--run-name" in words
    trained = subprocess.run(
        [
            sys.executable,
            "-m",
            "mnist_resnet",
            *words[1:],
            "--epochs",
            "1",
            "--limit-train-rows",
            "512",
            "--limit-val-rows",
            "256",
            "--limit-test-rows",
            "256",
            "--num-workers",
            "1",
            "--tracking",
            "none",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=paced(300),
        check=False,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (storage / "small-best" / "summary.json").exists()


def read_metrics_csv_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open() as stream:
        return list(csv.DictReader(stream))
