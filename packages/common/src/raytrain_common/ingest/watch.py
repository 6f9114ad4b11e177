"""The driver's watch over the CPU-only ingest nodes (--ingest-node-labels) while a run trains.

Ray Data runs the training ingest (read, decode, augment) on those nodes. When one is lost (a pod
evicted, a spot node reclaimed), Ray runs the tasks it held again and rebuilds the blocks lost with
it from their lineage, on the ingest nodes left or, when none is left, on a replacement once one
joins (KubeRay replaces a lost pod of a RayCluster's worker group); the ranks wait for their next
batch meanwhile and go on where they were, every row still trained once in the epoch
(the image pipeline's fault test kills the node mid-epoch). Neither Ray nor the ranks say any of this: a
rank blocked on its next batch looks like a hang. This watch says it in the driver's log, and
bounds the wait: with no ingest node alive for --ingest-wait-s, it stops the run as Ctrl-C does
(Ray Train's own SIGINT handler aborts the run's controller), and the run ends in one line saying
why and how to continue (`IngestLostError`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import TracebackType
from typing import Any

import ray

from raytrain_common.faults import read_progress
from raytrain_common.ray_start import ResourceError
from raytrain_common.storage import StoragePath

log = logging.getLogger(__name__)


class IngestLostError(RuntimeError):
    """No node matched --ingest-node-labels for --ingest-wait-s: the run was stopped."""


def matches(node: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a live node of `ray.nodes()` carries every one of `labels`."""
    found = node.get("Labels") or {}
    return bool(node["Alive"]) and all(found.get(key) == value for key, value in labels.items())


def check_cpus_for_ingest(labels: dict[str, str] | None, worker_cpus: float) -> None:
    """Refuse, before any worker starts, a cluster that leaves Ray Data's ingest no CPU: its
    tasks would wait forever for one, and every rank for its first batch, with nothing said (a
    2-CPU node and 2 workers of 1 CPU each). With `labels`, the nodes they select must have CPUs;
    without, the cluster must have CPUs beyond the workers' `worker_cpus`."""
    nodes = [node for node in ray.nodes() if node["Alive"]]
    if labels:
        cpus = sum(node["Resources"].get("CPU", 0.0) for node in nodes if matches(node, labels))
        where = "the nodes --ingest-node-labels " + ",".join(f"{k}={v}" for k, v in labels.items())
        where += " selects have"
    else:
        cpus = sum(node["Resources"].get("CPU", 0.0) for node in nodes) - worker_cpus
        where = f"the cluster has beside the workers' {worker_cpus:g}"
    if cpus < 1:
        raise ResourceError(
            f"Ray Data's ingest (read, decode, augment) needs a CPU, but {where} {max(cpus, 0):g}: "
            "the run would wait forever for its first batch. Lower --cpus-per-worker (e.g. 0.5) "
            "or --num-workers, or add CPUs (an ingest node group)"
        )


class IngestNodeWatch:
    """`with IngestNodeWatch(labels, wait_s, run_dir):` around `trainer.fit()`. A thread polls the
    cluster's nodes every `poll_s` seconds; nothing is watched without labels (the ingest then runs
    wherever the cluster has CPUs). A run it stopped ends in IngestLostError when the block exits,
    in place of the interrupt that stopped it."""

    def __init__(
        self,
        labels: dict[str, str] | None,
        wait_s: float,
        run_dir: StoragePath,
        poll_s: float = 1.0,
    ) -> None:
        self.labels, self.wait_s, self.run_dir, self.poll_s = labels, wait_s, run_dir, poll_s
        self.selector = ",".join(f"{key}={value}" for key, value in (labels or {}).items())
        self.gave_up_at_step: int | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="ingest-node-watch", daemon=True)

    def __enter__(self) -> IngestNodeWatch:
        if self.labels:
            self.thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.check()

    def ingest_nodes(self) -> set[str]:
        """The ids of the live nodes that carry every one of the labels."""
        labels = self.labels or {}
        return {node["NodeID"] for node in ray.nodes() if matches(node, labels)}

    def step(self) -> int:
        """The last step rank 0 noted (progress.json), 0 before the first."""
        try:
            progress = read_progress(self.run_dir)
        except (OSError, ValueError):  # mid-write on an object store: the next poll reads it
            return 0
        return int(progress["step"]) if progress else 0

    def watch(self) -> None:
        known, none_since = self.ingest_nodes(), None
        while not self.stopped.wait(self.poll_s):
            alive = self.ingest_nodes()
            for node in sorted(known - alive):
                log.warning(
                    "ingest node %s (%s) was lost near step %d: Ray runs its decode tasks again "
                    "and rebuilds the blocks lost with it on the ingest nodes left; training "
                    "waits for those batches, then goes on where it was",
                    node[:12],
                    self.selector,
                    self.step(),
                )
            for node in sorted(alive - known):
                log.warning(
                    "ingest node %s (%s) joined: decoding goes on there", node[:12], self.selector
                )
            known = alive
            if alive:
                none_since = None
            elif none_since is None:
                none_since = time.monotonic()
                log.warning(
                    "no live node matches --ingest-node-labels %s: training waits for its data "
                    "until one joins (KubeRay replaces a lost pod), %.0f s at most "
                    "(--ingest-wait-s)",
                    self.selector,
                    self.wait_s,
                )
            elif time.monotonic() - none_since >= self.wait_s:
                self.gave_up_at_step = self.step()
                log.error("no ingest node for %.0f s: stopping the run", self.wait_s)
                # Ray Train's SIGINT handler in the driver aborts the run's controller and workers.
                os.kill(os.getpid(), signal.SIGINT)
                return

    def check(self) -> None:
        """Raise IngestLostError when the watch stopped the run."""
        if self.gave_up_at_step is not None:
            raise IngestLostError(
                f"no live node matched --ingest-node-labels {self.selector} for "
                f"{self.wait_s:.0f} s (--ingest-wait-s), so the run was stopped near step "
                f"{self.gave_up_at_step}; its checkpoints are kept. Bring ingest nodes back (or "
                "drop --ingest-node-labels to decode on the training nodes) and run the same "
                "command again: it continues from the newest checkpoint, each row still once "
                "in its epoch"
            )
