"""Each RayJob's entrypoint on a Ray cluster of containers built from the image every RayJob
names (tools/build_image.py; tests/test_image.py runs the image as single pods): a head, a
CPU-only ingest node and a training node, each a container with its own file system, run as the
RayJobs' pods run (uid 1000, read-only root file system, no capabilities, the shared volume at
/mnt/runs), each job submitted from a fourth container as KubeRay's submitter does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from raytrain_testkit.pace import paced

pytestmark = pytest.mark.manifests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from build_image import POD, PODMAN, ULIMITS  # noqa: E402  (tools/ is not a package)

SMOKE_ANNOTATION = "raytrain-pipelines/cpu-smoke"
STORE = str(512 * 2**20)  # each node's object store: the manifests' 2-8 GiB do not fit this box


def rayjob(name: str) -> dict[str, Any]:
    text = (ROOT / "deploy" / "rayjob" / f"{name}.yaml").read_text()
    return next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "RayJob")


def smoke_runtime_env(document: dict[str, Any]) -> dict[str, Any]:
    """The manifest's runtime env at the CPU smoke size its annotation names, PLACEMENT_ARGS as
    the manifest sets them (node labels, CPUs per worker), no GPUs."""
    runtime_env = yaml.safe_load(document["spec"]["runtimeEnvYAML"])
    smoke = json.loads(document["metadata"]["annotations"][SMOKE_ANNOTATION])
    smoke_env = {k: v for k, v in smoke["env"].items() if k != "PLACEMENT_ARGS"}
    runtime_env["env_vars"].update(GPUS_PER_WORKER="0", **smoke_env)
    return runtime_env


def smoke_entrypoint(document: dict[str, Any], mount: str = "/mnt/runs") -> str:
    smoke = json.loads(document["metadata"]["annotations"][SMOKE_ANNOTATION])
    entrypoint = document["spec"]["entrypoint"].replace("--preset gpu", "--preset cpu")
    for old, new in smoke.get("replace", {}).items():
        entrypoint = entrypoint.replace(old, new)
    return entrypoint.replace("/mnt/runs", mount)


def kuberay_submitter_line(address: str, job_id: str, runtime_env: dict, entrypoint: str) -> str:
    """The submitter pod's shell line as KubeRay 1.x builds it (GetK8sJobCommand): words joined
    by spaces, the runtime env Go-quoted (`strconv.Quote`, the same as a JSON string for this
    ASCII), the entrypoint pasted unquoted; the pod runs it with `/bin/bash -c`."""
    quoted_env = json.dumps(json.dumps(runtime_env))
    return (
        f"if ray job status --address {address} {job_id} >/dev/null 2>&1 ; "
        f"then ray job logs --address {address} --follow {job_id} ; "
        f"else ray job submit --address {address} --runtime-env-json {quoted_env} "
        f"--submission-id {job_id} -- {entrypoint} ; fi"
    )


@dataclass
class ContainerCluster:
    network: str
    token: str
    volume: Path
    image: str
    names: list[str]

    def env(self) -> list[str]:
        return ["-e", "RAY_AUTH_MODE=token", "-e", f"RAY_AUTH_TOKEN={self.token}"]

    def start(self, name: str, ray_start: list[str], shm: str = "1g") -> None:
        """A Ray node in a container of its own file system, as the RayJob's pods: the shared
        volume at /mnt/runs, the cluster's token."""
        podman = [*PODMAN, "run", "-d", "--rm", *ULIMITS, *POD, "--shm-size", shm]
        podman += ["--network", self.network, "--name", name, "--hostname", name]
        podman += ["-v", f"{self.volume}:/mnt/runs", *self.env(), "-e", "RAY_USAGE_STATS_ENABLED=0"]
        command = ["ray", "start", "--block", "--disable-usage-stats", *ray_start]
        subprocess.run([*podman, self.image, *command], check=True, capture_output=True)
        self.names.append(name)

    def run(self, command: list[str], name: str) -> subprocess.CompletedProcess[str]:
        """A container of its own on the network (KubeRay's submitter pod): no volume."""
        podman = [*PODMAN, "run", "--rm", *ULIMITS, *POD, "--network", self.network]
        podman += ["--name", name, *self.env()]
        return subprocess.run(
            [*podman, self.image, *command], capture_output=True, text=True, timeout=paced(900)
        )

    def wait_ready(self, nodes: int, timeout_s: float | None = None) -> None:
        """Until the head's Jobs API answers and `nodes` nodes are alive (KubeRay creates the
        submitter once the cluster is ready): `timeout_s`, else 180 s paced to the box."""
        probe = (
            "import os, ray, urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:8265/api/"
            "version', headers={'Authorization': 'Bearer ' + os.environ['RAY_AUTH_TOKEN']}));"
            f"ray.init(address='auto'); assert sum(n['Alive'] for n in ray.nodes()) == {nodes}"
        )
        deadline = time.monotonic() + (paced(180) if timeout_s is None else timeout_s)
        while True:
            done = subprocess.run(
                ["podman", "exec", "rt-head", "python", "-c", probe], capture_output=True, text=True
            )
            if done.returncode == 0:
                return
            assert time.monotonic() < deadline, done.stderr[-2000:]
            time.sleep(3)

    def node_id(self, name: str) -> str:
        probe = (
            "import ray; ray.init(address='auto'); print(ray.get_runtime_context().get_node_id())"
        )
        done = subprocess.run(
            ["podman", "exec", name, "python", "-c", probe], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def container_cluster(
    image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ContainerCluster]:
    """A head (no CPUs for tasks, as the manifests' head), a CPU-only ingest node and a training
    node, each a container with its own file system, on a podman network made for the test, with
    token authentication; the training node's labels and CPUs as mnist's PLACEMENT_ARGS ask (its
    two gpu-group pods' CPUs in one container, without GPUs)."""
    from raytrain_testkit.multinode import new_auth_token

    volume = tmp_path_factory.mktemp("container-cluster") / "runs"
    volume.mkdir()
    volume.chmod(0o777)  # the pods' uid 1000 writes here; CI runs as root
    network = f"raytrain-{uuid.uuid4().hex[:8]}"
    subprocess.run(["podman", "network", "create", network], check=True, capture_output=True)
    cluster = ContainerCluster(network, new_auth_token(), volume, image, [])
    head = ["--head", "--num-cpus=0", "--num-gpus=0", "--dashboard-host=0.0.0.0"]
    try:
        cluster.start("rt-head", [*head, f"--object-store-memory={STORE}"])
        joined = ["--address=rt-head:6379", f"--object-store-memory={STORE}"]
        cluster.start("rt-ingest", [*joined, "--num-cpus=4", "--labels=ray.io/node-group=ingest"])
        cluster.start("rt-gpu", [*joined, "--num-cpus=16", "--labels=ray.io/node-group=gpu"])
        cluster.wait_ready(nodes=3)
        yield cluster
    finally:
        for name in cluster.names:
            subprocess.run(["podman", "rm", "-f", "-t", "2", name], capture_output=True)
        subprocess.run(["podman", "network", "rm", "-f", network], capture_output=True)


def submit(cluster: ContainerCluster, name: str, entrypoint: str, runtime_env: dict) -> str:
    """The entrypoint submitted from a fourth container by KubeRay's own shell line; its output
    (`ray job submit` follows the job's log and exits non-zero when the job fails)."""
    job_id = f"{name}-{uuid.uuid4().hex[:6]}"
    line = kuberay_submitter_line("http://rt-head:8265", job_id, runtime_env, entrypoint)
    done = cluster.run(["/bin/bash", "-c", line], f"submitter-{job_id}")
    return f"exit {done.returncode}\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("name", ["mnist_resnet", "hf_finetune", "llm_fsdp"])
def test_each_rayjob_entrypoint_succeeds_on_a_cluster_of_containers(
    name: str, container_cluster: ContainerCluster
) -> None:
    """The RayJob's entrypoint, read from its YAML, submitted as KubeRay's submitter submits it:
    the job ends SUCCEEDED, its run folder is on the shared volume, and mnist's decode ran on the
    ingest container (its node labels), not where the workers train."""
    document = rayjob(name)
    said = submit(
        container_cluster,
        name.replace("_", "-"),
        smoke_entrypoint(document),
        smoke_runtime_env(document),
    )
    assert said.startswith("exit 0") and "succeeded" in said, said[-4000:]
    run_name = re.search(r"--run-name (\S+)", document["spec"]["entrypoint"])[1]
    summary = json.loads((container_cluster.volume / run_name / "summary.json").read_text())
    assert summary["steps_done"] >= 1
    if name == "mnist_resnet":
        ingest = container_cluster.node_id("rt-ingest")[:15]
        assert set(summary["decoded_on"]) == {ingest}, (summary["decoded_on"], ingest)


def test_a_node_local_path_handed_from_the_head_fails_on_a_cluster_of_containers(
    container_cluster: ContainerCluster,
) -> None:
    """mnist's entrypoint with its storage on the head's own disk (/tmp/runs, which the other
    containers do not have): on processes sharing one file system this would pass; here the job
    fails, naming the folder that is not there."""
    document = rayjob("mnist_resnet")
    entrypoint = smoke_entrypoint(document, mount="/tmp/runs")
    said = submit(container_cluster, "node-local", entrypoint, smoke_runtime_env(document))
    assert not said.startswith("exit 0"), said[-4000:]
    assert "/tmp/runs" in said, said[-4000:]
