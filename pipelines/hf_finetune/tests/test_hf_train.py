"""Real 2-worker Ray Train runs of the HF Trainer on VADER slices: a user's CSV, bad settings, an
exact mid-epoch resume (the lost worker, learning and prediction: test_hf_faults.py)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

from hf_finetune.cli import main
from hf_finetune.config import TrainConfig, cpu_preset
from hf_finetune.train import run
from raytrain_common.configs import ConfigError
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_testkit.console import console_noise
from raytrain_testkit.tracked_runs import metric_history

pytestmark = pytest.mark.ray


def small_config(storage: Path, data_dir: StoragePath, **changes: Any) -> TrainConfig:
    """The CPU preset on a slice of VADER that trains in about a minute on 2 cores."""
    base = dataclasses.replace(
        cpu_preset(),
        storage_path=str(storage),
        data_dir=data_dir.uri,
        epochs=2,
        limit_train_rows=1024,
        limit_val_rows=384,
        limit_test_rows=384,
        log_every_steps=8,
        tracking="none",  # MLflow is checked by the tests that turn it on
    )
    return dataclasses.replace(base, **changes)


def read_trainer_history(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The Trainer's log history as the run's latest checkpoint holds it."""
    state = json.loads((Path(summary["latest_checkpoint"]) / "trainer_state.json").read_text())
    return state["log_history"]


def test_a_users_csv_trains_with_flags_alone_and_a_run_stopped_mid_epoch_resumes_exactly(
    ray_cluster: None,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    write_reviews: Callable[..., Path],
) -> None:
    """Three classes and the user's own column names: prepare, train, evaluate, predict by CLI.

    The same flags train it twice more, checkpointing every 5 steps and at epoch ends: stopped
    mid-epoch 2 and rerun, the Trainer skips the batches already seen and the resumed epoch is
    drawn in its own order, so every step's loss matches the uninterrupted run's to 1e-5 relative
    (measured: identical; a resumed epoch drawn in the wrong order was 5-50 % off on VADER)."""
    csv = write_reviews(tmp_path / "reviews.csv", rows=240, encoding="latin-1")
    storage = ["--storage-path", str(tmp_path)]
    columns = ["--text-column", "comment", "--label-column", "rating"]
    # Latin-1 read as UTF-8: refused with the place and the encoding to pass, nothing written.
    assert main(["prepare", "--dataset", str(csv), *columns, *storage]) == 2
    error = capfd.readouterr().err
    assert "reviews.csv is not valid utf-8 text: byte " in error and "(line 2, " in error
    assert "pass --encoding cp1252" in error and "binary" not in error
    assert not (tmp_path / "data").exists()
    assert ray.is_initialized(), "a refused command ended the cluster its caller had connected to"
    assert (
        main(["prepare", "--dataset", str(csv), "--encoding", "latin-1", *columns, *storage]) == 0
    )
    train = ["train", "--epochs", "2", "--global-batch-size", "16", "--lr", "2e-4", *storage]
    train += ["--checkpoint-every-steps", "5", "--log-every-steps", "1"]  # MLflow on: the default
    assert main([*train, "--run-name", "reviews"]) == 0
    assert main(["evaluate", "--run-name", "reviews", *storage]) == 0
    assert console_noise("".join(capfd.readouterr())) == []  # prepare, train, evaluate: quiet
    (tmp_path / "new.txt").write_text(
        "wonderful dinner, we will come back soon\n\nthe food was cold\n"
    )
    capfd.readouterr()
    assert main(["predict", "--run-name", "reviews", *storage, str(tmp_path / "new.txt")]) == 0
    out, err = capfd.readouterr()
    assert console_noise(out + err) == []
    lines = out.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["great", "bad"]
    whole = read_summary(tmp_path / "reviews")
    assert whole["labels"] == ["bad", "great", "okay"]
    assert whole["test"]["test_accuracy"] == 1.0  # three templates: an easy, exact task
    evaluated = whole["evaluations"]  # `evaluate` scored the same checkpoint again, apart
    assert [(e["checkpoint"], e["test_accuracy"]) for e in evaluated] == [
        (whole["best_checkpoint"], 1.0)
    ]
    assert whole["sentences_per_s"] > 0  # the steady rate over the progress lines after the first

    # Stopped mid-epoch 2, then the same command again.
    steps, per_epoch = whole["steps_done"], whole["steps_done"] // 2
    stop = per_epoch + per_epoch // 2 + 1
    assert stop % 5 and per_epoch % 5  # the stop's own save, apart from the periodic ones
    assert main([*train, "--run-name", "cut", "--stop-at-step", str(stop)]) == 0
    stopped = read_summary(tmp_path / "cut")
    assert stopped["steps_done"] == stop
    # The stop evaluated and saved once (the Trainer would end the stopped epoch with a second).
    evaluated_at = [row["step"] for row in read_trainer_history(stopped) if "val_loss" in row]
    assert evaluated_at == sorted({*range(5, stop, 5), per_epoch, stop})
    assert main([*train, "--run-name", "cut"]) == 0
    resumed = read_summary(tmp_path / "cut")
    assert resumed["steps_done"] == steps

    def step_losses(summary: dict[str, Any]) -> dict[int, float]:
        return {row["step"]: row["loss"] for row in read_trainer_history(summary) if "loss" in row}

    expected, got = step_losses(whole), step_losses(resumed)
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    assert resumed["final"]["val_f1"] == pytest.approx(whole["final"]["val_f1"], abs=1e-6)
    assert [r["cause"] for r in resumed["restarts"]] == ["rerun"]
    assert resumed["restarts"][0]["resumed_at_step"] == stop
    # MLflow (on by default): the stopped run and its rerun are one MLflow run, every step once.
    storage_path = resolve_storage(tmp_path)
    cut = storage_path.join("cut")
    tracked = metric_history(storage_path, "hf_finetune", cut, "train_loss_interval")
    assert len(tracked["runs"]) == 1 and tracked["runs"][0].info.status == "FINISHED"
    assert [step for step, _ in tracked["steps"]] == list(range(1, steps + 1))
    f1 = metric_history(storage_path, "hf_finetune", cut, "val_f1")["steps"]
    assert f1[-1][1] == pytest.approx(resumed["final"]["val_f1"], abs=1e-6)


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def test_bad_settings_fail_before_training(
    ray_cluster: None, vader_dir: StoragePath, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"global_batch_size=30 does not divide evenly over 4"):
        run(small_config(tmp_path, vader_dir, num_workers=4, global_batch_size=30))
    status = main(
        [
            "train",
            "--data-dir",
            vader_dir.uri,
            "--model",
            str(tmp_path),
            "--storage-path",
            str(tmp_path),
        ]
    )
    assert status == 2
    assert "is a folder without config.json" in capsys.readouterr().err
