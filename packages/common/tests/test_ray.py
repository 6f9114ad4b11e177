"""Real Ray: start-up sizing, resource checks, and rank-0 checkpoints that every rank reports."""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer

from raytrain_common.checkpoint import load_state, resume_checkpoint, save_state, write_manifest
from raytrain_common.configs import RayTrainSettings, build_run_config, build_scaling_config
from raytrain_common.ray_start import (
    DATA_CPUS,
    ResourceError,
    alive_nodes,
    init_ray,
    require_resources,
)
from raytrain_common.storage import resolve_storage
from raytrain_testkit.pace import paced

pytestmark = pytest.mark.ray


def test_local_cluster_leaves_cpus_for_ray_data(ray_cluster: None) -> None:
    cpus = ray.cluster_resources()["CPU"]
    assert cpus >= max(os.cpu_count() or 1, 2) + 2
    assert alive_nodes() == 1
    assert init_ray(train_cpus=2) is True  # already running: joins, does not restart


def test_missing_gpus_fail_at_once_with_the_fix(ray_cluster: None) -> None:
    # More GPUs than the cluster has, whether this machine has none or some.
    wanted = int(ray.cluster_resources().get("GPU", 0)) + 2
    with pytest.raises(
        ResourceError,
        match=rf"needs GPU={wanted} but the Ray cluster has CPU=\d+, GPU=\d+ .*Drop --use-gpu",
    ):
        require_resources({"CPU": 2, "GPU": wanted}, hint="Drop --use-gpu.")
    require_resources({"CPU": 1})


def fit(storage: Path, steps: int) -> ray.train.Result:
    def train_fn(config: dict[str, Any]) -> None:
        """Each rank reports every step; resumes from the run's latest state when there is one.

        Defined inside the test so Ray ships it by value: workers cannot import test modules.
        """
        run_dir = resolve_storage(config["run_dir"])
        checkpoint = resume_checkpoint(ray.train.get_checkpoint(), run_dir)
        start = 0
        if checkpoint is not None:
            with checkpoint.as_directory() as folder:
                start = load_state(folder)["step"]
        rank = ray.train.get_context().get_world_rank()
        for step in range(start + 1, config["steps"] + 1):
            metrics = {"step": step, "rank_seen": rank, "resumed_from": start}
            if rank != 0:  # every rank reports (a barrier); rank 0 with the checkpoint
                ray.train.report(metrics, checkpoint=None)
                continue
            with tempfile.TemporaryDirectory() as folder:
                save_state(folder, {"step": step, "weights": torch.full((2,), float(step))})
                write_manifest(folder)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))

    settings = RayTrainSettings(
        run_name="ranks", storage_path=str(storage), num_workers=2, num_to_keep=5
    )
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"steps": steps, "run_dir": str(storage / "ranks")},
        scaling_config=build_scaling_config(settings),
        run_config=build_run_config(settings, score_attribute="step", score_order="max"),
    )
    return trainer.fit()


def test_rank_zero_saves_every_rank_reports_and_a_rerun_resumes(
    ray_cluster: None, tmp_path: Path
) -> None:
    first = fit(tmp_path, steps=2)
    assert first.metrics["step"] == 2
    assert first.metrics["rank_seen"] == 0  # the checkpointed report is rank 0's
    folders = sorted(p.name for p in (tmp_path / "ranks").glob("checkpoint_*") if p.is_dir())
    assert len(folders) == 2
    for folder in folders:  # one state file per checkpoint: only rank 0 wrote
        assert sorted(os.listdir(tmp_path / "ranks" / folder)) == [
            "manifest-rank0.json",
            "manifest-world.json",
            "state.pt",
        ]

    second = fit(tmp_path, steps=3)  # same run name: continues after step 2
    assert second.metrics["step"] == 3
    assert second.metrics["resumed_from"] == 2
    with second.checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / "state.pt", weights_only=True)
    assert torch.equal(state["weights"], torch.full((2,), 3.0))


def test_a_stale_cluster_address_file_does_not_stop_a_local_start() -> None:
    """Ray records the last `ray start` (or test cluster) in <temp>/ray/ray_current_cluster and,
    when ray.init gets no address, joins it, even long after that cluster died, and then refuses
    num_cpus. A run without RAY_ADDRESS must start its own cluster whatever that file says."""
    temp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # Ray's socket paths are short
    (temp / "ray").mkdir()
    (temp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")  # nothing listens there
    script = (
        "import ray\nfrom raytrain_common.ray_start import init_ray\nassert "
        "init_ray(train_cpus=1) is True\nprint('CPUS', "
        "ray.cluster_resources()['CPU'])\nray.shutdown()\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "RAY_TMPDIR": str(temp)},
        capture_output=True,
        text=True,
        timeout=paced(120),
        check=False,
    )
    shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CPUS" in done.stdout


def test_local_cluster_stop_ends_every_process_of_its_cluster_and_spares_the_rest() -> None:
    """`python -m raytrain_common.local_cluster stop DIR` after `ray start --head --temp-dir DIR`:
    every process of that cluster ends, the Ray Client server too (`ray start` leaves it with no
    parent of the cluster's, naming only the GCS's address; it was left running, holding its
    port), and a process that merely names DIR on its command line is spared."""
    import psutil

    from raytrain_common.local_cluster import cluster_processes, stop

    temp = Path(tempfile.mkdtemp(prefix="rt-stop-", dir="/tmp"))  # Ray's socket paths are short
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    gcs_port, client_port = ports
    bin_dir = Path(sys.executable).parent
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", f"--temp-dir={temp}"]
    )
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    try:
        subprocess.run(
            [
                str(bin_dir / "ray"),
                "start",
                "--head",
                f"--port={gcs_port}",
                f"--ray-client-server-port={client_port}",
                "--include-dashboard=false",
                "--num-cpus=0",
                f"--temp-dir={temp}",
                "--disable-usage-stats",
            ],
            check=True,
            capture_output=True,
            text=True,
            env=env,
            timeout=paced(120),
        )
        started = cluster_processes(temp)
        assert any("ray.util.client.server" in " ".join(p.cmdline()) for p in started)
        done = subprocess.run(
            [sys.executable, "-m", "raytrain_common.local_cluster", "stop", str(temp)],
            capture_output=True,
            text=True,
            timeout=paced(60),
        )
        assert done.returncode == 0, done.stderr
        assert f"stopped {len(started)} process(es)" in done.stdout
        left = []
        for process in psutil.process_iter(["cmdline"]):
            arguments = " ".join(process.info["cmdline"] or [])
            if process.pid != bystander.pid and (
                str(temp) in arguments or f":{gcs_port}" in arguments
            ):
                left.append(arguments)
        assert not left, left
        assert bystander.poll() is None
    finally:
        bystander.kill()
        stop(temp)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_started_cluster_takes_commands_with_its_token_and_refuses_them_without() -> None:
    """`local_cluster start DIR` (what `nox -s cluster` runs): a head that a process given the
    printed variables attaches to, with the CPUs a command's own cluster would have; without the
    token it is refused; `stop DIR` ends it."""
    temp = Path(tempfile.mkdtemp(prefix="rt-start-", dir="/tmp"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    attach = [sys.executable, "-c", "import ray; ray.init(); print(ray.cluster_resources()['CPU'])"]
    try:
        start = [sys.executable, "-m", "raytrain_common.local_cluster", "start", str(temp)]
        started = subprocess.run(
            [*start, f"--port={port}"],
            capture_output=True,
            text=True,
            env=env,
            timeout=paced(120),
            check=True,
        )
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in started.stdout.splitlines()
            if line.startswith("export ")
        )
        assert set(exports) == {"RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"}
        assert oct(Path(exports["RAY_AUTH_TOKEN_PATH"]).stat().st_mode & 0o777) == "0o600"
        joined = subprocess.run(
            attach, capture_output=True, text=True, env={**env, **exports}, timeout=paced(120)
        )
        assert joined.returncode == 0, joined.stderr[-2000:]
        assert float(joined.stdout.split()[-1]) == math.ceil((os.cpu_count() or 1) + DATA_CPUS)
        refused = subprocess.run(
            attach,
            capture_output=True,
            text=True,
            env={**env, "RAY_ADDRESS": exports["RAY_ADDRESS"]},
            timeout=paced(120),
        )
        assert refused.returncode != 0
    finally:
        subprocess.run(
            [sys.executable, "-m", "raytrain_common.local_cluster", "stop", str(temp)],
            capture_output=True,
            timeout=paced(120),
        )
        shutil.rmtree(temp, ignore_errors=True)
