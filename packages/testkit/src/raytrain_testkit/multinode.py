"""A real multi-node Ray cluster on one machine, for the fault tests every pipeline shares.

Each node is its own raylet with its own resources (`ray.cluster_utils.Cluster`); killing a node
kills its raylet and every worker on it, as losing a machine does. The run's storage folder is a
local folder that every node of this cluster really shares (they are one machine), so runs pass
`--storage-is-shared`. A pipeline's driver runs as a subprocess with `RAY_ADDRESS` set, as in a
RayJob, so tests can kill it too; this process keeps a connection to the cluster to watch the run
and to inject faults (drain a node through the GCS, remove it, add one back).

Token authentication is on, with a token made for the cluster (never whatever ~/.ray/auth_token
holds): every node, driver and CLI call started from here gets it through RAY_AUTH_MODE=token and
RAY_AUTH_TOKEN, and a node or client without it is refused, as on a real cluster of ours.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from raytrain_testkit.memory_cap import NO_CAP_MB, CappedRun, MemoryCap
from raytrain_testkit.pace import paced
from raytrain_testkit.s3 import free_port

NodeHandle = Any  # ray._private.node.Node: the processes of one node


class MultiNodeCluster:
    """A head node plus worker nodes; the helpers below are the faults a real cluster inflicts."""

    def __init__(
        self,
        *,
        head_cpus: float,
        object_store_mb: int = 300,
        connect: bool = True,
        head_labels: Mapping[str, str] | None = None,
    ) -> None:
        self.object_store_bytes = object_store_mb * 1024 * 1024
        self.connected = connect
        self.auth_token: str | None = None
        self.cluster = Cluster(
            initialize_head=True,
            connect=connect,
            head_node_args={
                "num_cpus": head_cpus,
                "object_store_memory": self.object_store_bytes,
                "labels": dict(head_labels or {}),
                # A dashboard of its own (the State API asks it): on Ray's fixed default port
                # (8265) a second cluster on the machine, such as the other pytest process's,
                # starts without one, and every State API call at its address then fails.
                "dashboard_port": free_port(),
                # A killed node is declared dead after 3 missed 1-s health checks (Ray's default:
                # 5 missed 3-s ones), so each lost node costs the fault tests seconds, not ~15 s.
                "_system_config": {
                    "health_check_period_ms": 1000,
                    "health_check_failure_threshold": 3,
                },
            },
        )

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(
        self,
        cpus: float,
        *,
        memory_cap: MemoryCap | None = None,
        labels: Mapping[str, str] | None = None,
        **resources: float,
    ) -> NodeHandle:
        """A worker node with `cpus` and Ray node `labels` (as a RayJob's group gives its pods);
        inside `memory_cap` (its raylet, and so every worker it starts) when given, as a pod
        under its memory limit. Called from the main thread (Ray sets signal handlers)."""
        node = self.cluster.add_node(
            num_cpus=cpus,
            resources=resources or None,
            object_store_memory=self.object_store_bytes,
            labels=dict(labels or {}),
        )
        if memory_cap is not None:
            for infos in node.all_processes.values():
                for info in infos:
                    memory_cap.adopt(info.process.pid)
        self.cluster.wait_for_nodes()
        return node

    def remove_node(self, node_id: str, *, graceful: bool = False) -> None:
        """Kill every process of the node (its raylet first), without notice unless `graceful`."""
        node = self.node_handle(node_id)
        self.cluster.remove_node(node, allow_graceful=graceful)

    def node_handle(self, node_id: str) -> NodeHandle:
        for node in self.cluster.worker_nodes:
            if node.node_id == node_id:
                return node
        head = self.cluster.head_node
        where = "the head node" if head is not None and head.node_id == node_id else "unknown"
        raise LookupError(f"node {node_id} is {where}, not a worker node this harness can remove")

    def is_head(self, node_id: str) -> bool:
        return self.cluster.head_node is not None and self.cluster.head_node.node_id == node_id

    def drain(self, node_id: str, *, reason: str = "PREEMPTION", deadline_s: int | None) -> None:
        """Ask the GCS to drain the node, as a cloud's spot-reclaim notice does (`ray
        drain-node`)."""
        command = [
            str(Path(sys.executable).with_name("ray")),
            "drain-node",
            "--address",
            self.address,
            "--node-id",
            node_id,
            "--reason",
            f"DRAIN_NODE_REASON_{reason}",
            "--reason-message",
            "fault test",
        ]
        if deadline_s is not None:
            command += ["--deadline-remaining-seconds", str(deadline_s)]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=paced(60))

    def alive_node_ids(self) -> list[str]:
        if not self.connected:  # asked of the GCS directly
            from ray._raylet import GcsClient

            nodes = GcsClient(address=self.address).get_all_node_info()
            return [node_id.hex() for node_id, node in nodes.items() if node.state == 0]
        return [node["NodeID"] for node in ray.nodes() if node["Alive"]]

    def train_workers(self) -> dict[int, str]:
        """{world rank: node id} of the live worker group of the newest Ray Train run.

        From Ray Train's own state actor (what its dashboard shows; drivers started by `Driver` turn
        it on); empty until the group starts.
        """
        from ray.train.v2._internal.state.state_actor import get_state_actor

        actor = get_state_actor()
        if actor is None:
            return {}
        attempts = ray.get(actor.get_train_run_attempts.remote())
        newest = [
            attempt
            for run_attempts in attempts.values()
            for attempt in run_attempts.values()
            if attempt.status.name == "RUNNING"
        ]
        if not newest:
            return {}
        attempt = max(newest, key=lambda a: a.start_time_ns)
        return {worker.world_rank: worker.node_id for worker in attempt.workers}

    def node_of_rank(self, rank: int, timeout_s: float | None = None) -> str:
        """The node id hosting `rank` of the running worker group (waits for the group to start:
        `timeout_s`, else 120 s paced to the box)."""
        allowed_s = paced(120) if timeout_s is None else timeout_s
        workers = wait_for(lambda: self.train_workers().get(rank), allowed_s, f"rank {rank}")
        return workers

    def shutdown(self) -> None:
        if self.connected:
            ray.shutdown()
        self.cluster.shutdown()


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.5) -> Any:
    """Poll until `condition()` is truthy and return it; TimeoutError naming `what` otherwise.
    `timeout_s` is the caller's, already paced (`raytrain_testkit.pace.paced`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")


AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def new_auth_token() -> str:
    """A random token of the kind `ray get-auth-token --generate` writes (hex, 256 bits)."""
    return secrets.token_hex(32)


def process_token() -> str | None:
    """The token this process was given explicitly (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN)."""
    if os.environ.get("RAY_AUTH_MODE") == "token" and os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"]
    return None


@contextmanager
def token_auth(token: str) -> Iterator[str]:
    """This process and every process it starts use token auth with `token`; restored afterwards.

    Ray caches the mode and token per process: they are reloaded when they change, which is safe
    only while this process is connected to no other cluster (then it must already hold `token`).
    """
    saved = {name: os.environ.get(name) for name in AUTH_VARIABLES}
    changed = process_token() != token or saved["RAY_AUTH_TOKEN_PATH"] is not None
    if changed and ray.is_initialized():
        raise RuntimeError(
            "this process is connected to a Ray cluster with another token: give the new cluster "
            "the same one (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN) or run it from another process"
        )
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    if changed:
        _reload_auth()
    try:
        yield token
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if changed and not ray.is_initialized():
            _reload_auth()


def _reload_auth() -> None:
    """Make Ray's per-process config and token cache read the environment again."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def multinode_cluster(
    *,
    head_cpus: float,
    connect: bool = True,
    head_labels: Mapping[str, str] | None = None,
    object_store_mb: int = 300,
) -> Iterator[MultiNodeCluster]:
    """A fresh cluster with token auth (the caller adds worker nodes), shut down afterwards
    whatever happens. `cluster.auth_token` is its token.

    Unconnected (`connect=False`), it can run beside a cluster this process uses, for tests whose
    drivers are subprocesses (`RAY_ADDRESS` set) and that only start, count and stop nodes.
    """
    if connect and ray.is_initialized():
        raise RuntimeError(
            "this process is already connected to a Ray cluster: run fault tests on their own "
            "(`nox -s faults`, or `pytest -m faults`)"
        )
    # The preemption watcher polls drains every 5 s by default; 1 s keeps tests short.
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")
    # As a pipeline's own local cluster (ray_start.init_ray): no idle worker per CPU prestarted
    # when the first driver connects; the runs start the workers they use.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # The process's own token when it was given one (so a process that already uses a cluster
    # with it can start this one too), else a new one: never whatever ~/.ray/auth_token holds.
    with token_auth(process_token() or new_auth_token()) as token:
        harness = MultiNodeCluster(
            head_cpus=head_cpus,
            connect=connect,
            head_labels=head_labels,
            object_store_mb=object_store_mb,
        )
        harness.auth_token = token
        try:
            yield harness
        finally:
            harness.shutdown()


class Driver:
    """A pipeline's `train` command as its own process against the cluster (a RayJob's
    entrypoint)."""

    def __init__(
        self,
        command: Sequence[str],
        address: str,
        log_file: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.log_file = log_file
        env = {
            **os.environ,
            "RAY_ADDRESS": address,
            "PYTHONUNBUFFERED": "1",
            # Ray Train's run-state actor (its dashboard's source), which `train_workers` reads.
            "RAY_TRAIN_ENABLE_STATE_TRACKING": "1",
            **(env or {}),
        }
        self.stream = log_file.open("ab")
        self.process = subprocess.Popen(
            list(command), env=env, stdout=self.stream, stderr=subprocess.STDOUT
        )

    def kill(self) -> None:
        """SIGKILL, as a driver pod evicted or OOM-killed goes: no cleanup runs."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=paced(60))
        self.stream.close()

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise TimeoutError(
                f"the driver ran past {timeout_s:.0f} s; log:\n{self.log()}"
            ) from None
        self.stream.close()
        return code

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")[-6000:]


# A command run against a cluster address → (exit code, its log).
Run = Callable[[str], tuple[int, str]]


@contextmanager
def capped_node(
    limit_mb: int = NO_CAP_MB, object_store_mb: int = 300
) -> Iterator[tuple[str, MemoryCap]]:
    """A fresh cluster of a head without CPUs and one 2-CPU node inside a cap of `limit_mb` (the
    default only measures), each node's object store `object_store_mb` (shared memory, charged
    to the cap as a pod's /dev/shm is to its limit): the cluster's address, for drivers outside
    the node, and the cap."""
    cap = MemoryCap(limit_mb=limit_mb)
    try:
        with multinode_cluster(
            head_cpus=0, connect=False, object_store_mb=object_store_mb
        ) as cluster:
            cluster.add_node(cpus=2, memory_cap=cap)
            yield cluster.address, cap
    finally:
        cap.close()


def train_capped_after_baseline(
    baseline: Run,
    capped: Run,
    margin_mb: float,
    object_store_mb: int = 300,
) -> CappedRun:
    """On a `capped_node`: `baseline` runs with no real limit and gives the most memory the node
    held; `capped` then runs with the node capped at that plus `margin_mb`. Both are drivers
    outside the node (subprocesses). Size the margin well above what a worker's memory varies from
    run to run (hf: its largest worker held 1,386 MiB in one run and 1,670 MiB in others): a
    margin within that spread makes a low baseline kill the capped run."""
    with capped_node(object_store_mb=object_store_mb) as (address, cap):
        with cap.sampling_held() as before:
            code, log = baseline(address)
            if code != 0:
                raise RuntimeError(f"the baseline run failed (exit {code}):\n{log[-3000:]}")
        cap.set_limit(int(before.peak_mb + margin_mb))
        with cap.sampling_held() as after:
            code, log = capped(address)
        return CappedRun(before, after, cap.limit_mb, cap.oom_kills, code, log)
