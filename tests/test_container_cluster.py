"""Each RayJob's entrypoint on a Ray cluster of containers built from the image every RayJob
names (tools/build_image.py; tests/test_image.py runs the image as single pods): a head, a
CPU-only ingest node and a training node, each a container with its own file system, run as the
manifests' pods run (`pod_flags`: their securityContext and emptyDirs read from the YAML; the
shared volume at /mnt/runs), each job submitted from a fourth container by the shell line
KubeRay's operator gives its submitter, and judged as the operator judges it: by the job's status
in the Jobs API."""

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

from build_image import PODMAN, ULIMITS, pod_flags  # noqa: E402  (tools/ is not a package)

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


# The KubeRay release the manifests target, and where its submitter's line comes from.
KUBERAY = "v1.7.0"
KUBERAY_SOURCE = "ray-operator/controllers/ray/common/job.go (BuildJobSubmitCommand)"


def kuberay_submitter_command(
    address: str, job_id: str, runtime_env: dict, entrypoint: str
) -> list[str]:
    """The submitter container's command as KubeRay v1.7.0 builds it in K8sJobMode: the words of
    BuildJobSubmitCommand joined by spaces (the runtime env Go-quoted by `strconv.Quote`, the same
    as a JSON string for this ASCII; the entrypoint pasted unquoted), run by `/bin/bash -ce --`
    (rayjob_controller.go, configureSubmitterContainer). It waits for the dashboard's GCS health,
    submits with --no-wait unless the id is known, then follows the logs: its exit status is
    not the job's (the operator reads that from the Jobs API)."""
    health_url = f"{address}/api/gcs_healthz"
    health = (
        'python -c "import urllib.request; '
        f"r=urllib.request.urlopen('{health_url}', timeout=10); "
        "exit(0 if b'success' in r.read() else 1)\""
    )
    waiting = json.dumps(f"Waiting for Ray Dashboard GCS to become healthy at {address} ...")
    quoted_env = json.dumps(json.dumps(runtime_env))
    words = [
        *("until", health, ">/dev/null", "2>&1", ";", "do", "echo", waiting, ";"),
        *("sleep", "2", ";", "done", ";"),
        *("if", "!", "ray", "job", "status", "--address", address, job_id, ">/dev/null", "2>&1"),
        *(";", "then", "ray", "job", "submit", "--address", address, "--no-wait"),
        *("--runtime-env-json", quoted_env, "--submission-id", job_id, "--", entrypoint, ";"),
        *("fi", ";", "ray", "job", "logs", "--address", address, "--follow", job_id),
    ]
    return ["/bin/bash", "-ce", "--", " ".join(words)]


def manifest_pod_flags(group: str) -> list[str]:
    """The podman flags of mnist's RayJob pod `group` ("head", a worker group's name,
    "submitter"), from the manifest (every manifest's pods run alike: tests/test_manifests.py)."""
    spec = rayjob("mnist_resnet")["spec"]
    if group == "submitter":
        template = spec["submitterPodTemplate"]
    elif group == "head":
        template = spec["rayClusterSpec"]["headGroupSpec"]["template"]
    else:
        groups = spec["rayClusterSpec"]["workerGroupSpecs"]
        template = next(g["template"] for g in groups if g["groupName"] == group)
    pod = template["spec"]
    return pod_flags(pod, pod["containers"][0])


@dataclass
class ContainerCluster:
    network: str
    token: str
    volume: Path
    image: str
    names: list[str]

    def env(self) -> list[str]:
        return ["-e", "RAY_AUTH_MODE=token", "-e", f"RAY_AUTH_TOKEN={self.token}"]

    def start(self, name: str, group: str, ray_start: list[str]) -> None:
        """A Ray node in a container of its own file system, run as the manifest's pod `group`
        runs: the shared volume at /mnt/runs, the cluster's token."""
        podman = [*PODMAN, "run", "-d", "--rm", *ULIMITS, *manifest_pod_flags(group)]
        podman += ["--network", self.network, "--name", name, "--hostname", name]
        podman += ["-v", f"{self.volume}:/mnt/runs", *self.env(), "-e", "RAY_USAGE_STATS_ENABLED=0"]
        command = ["ray", "start", "--block", "--disable-usage-stats", *ray_start]
        subprocess.run([*podman, self.image, *command], check=True, capture_output=True)
        self.names.append(name)

    def run(self, command: list[str], name: str) -> subprocess.CompletedProcess[str]:
        """A container of its own on the network, run as the manifest's submitter pod: no
        shared volume."""
        podman = [*PODMAN, "run", "--rm", *ULIMITS, *manifest_pod_flags("submitter")]
        podman += ["--network", self.network]
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

    def job_status(self, job_id: str) -> str:
        """The job's status from the head's Jobs API (with the cluster's token), once it is final
        (`ray job logs --follow` may return a moment before the status is written)."""
        probe = (
            "from ray.job_submission import JobSubmissionClient; "
            f"print(JobSubmissionClient('http://127.0.0.1:8265').get_job_status('{job_id}').value)"
        )
        deadline = time.monotonic() + paced(60)
        while True:
            done = subprocess.run(
                ["podman", "exec", "rt-head", "python", "-c", probe], capture_output=True, text=True
            )
            lines = done.stdout.strip().splitlines()
            status = (
                lines[-1] if done.returncode == 0 and lines else f"unread: {done.stderr[-500:]}"
            )
            if status in ("SUCCEEDED", "FAILED", "STOPPED") or time.monotonic() > deadline:
                return status
            time.sleep(2)

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
        cluster.start("rt-head", "head", [*head, f"--object-store-memory={STORE}"])
        joined = ["--address=rt-head:6379", f"--object-store-memory={STORE}"]
        ingest = [*joined, "--num-cpus=4", "--labels=ray.io/node-group=ingest"]
        cluster.start("rt-ingest", "ingest", ingest)
        cluster.start("rt-gpu", "gpu", [*joined, "--num-cpus=16", "--labels=ray.io/node-group=gpu"])
        cluster.wait_ready(nodes=3)
        yield cluster
    finally:
        for name in cluster.names:
            subprocess.run(["podman", "rm", "-f", "-t", "2", name], capture_output=True)
        subprocess.run(["podman", "network", "rm", "-f", network], capture_output=True)


@dataclass
class Submitted:
    status: str  # the job's status in the Jobs API, as the operator reads it
    output: str  # the submitter's console: `ray job logs --follow`


def submit(cluster: ContainerCluster, name: str, entrypoint: str, runtime_env: dict) -> Submitted:
    """The entrypoint submitted from a fourth container by KubeRay's own submitter command, then
    the job's status read from the head's Jobs API (KubeRay's operator polls it there and sets the
    RayJob's status from it; the submitter's exit status carries nothing of it)."""
    job_id = f"{name}-{uuid.uuid4().hex[:6]}"
    command = kuberay_submitter_command("http://rt-head:8265", job_id, runtime_env, entrypoint)
    done = cluster.run(command, f"submitter-{job_id}")
    return Submitted(cluster.job_status(job_id), done.stdout + done.stderr)


@pytest.mark.parametrize("name", ["mnist_resnet", "hf_finetune", "llm_fsdp"])
def test_each_rayjob_entrypoint_succeeds_on_a_cluster_of_containers(
    name: str, container_cluster: ContainerCluster
) -> None:
    """The RayJob's entrypoint, read from its YAML, submitted as KubeRay v1.7's submitter submits
    it: the job's status in the Jobs API is SUCCEEDED, its run folder is on the shared volume, and
    mnist's decode ran on the ingest container (its node labels), not where the workers train."""
    document = rayjob(name)
    submitted = submit(
        container_cluster,
        name.replace("_", "-"),
        smoke_entrypoint(document),
        smoke_runtime_env(document),
    )
    assert submitted.status == "SUCCEEDED", submitted.output[-4000:]
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
    containers do not have) and without --storage-is-shared: `train` refuses it before any worker
    starts, naming the path and what to use instead (the shared-storage check of
    raytrain_common.storage: without it, the job would fail later, on another node, for another
    reason), and the job's status is FAILED."""
    document = rayjob("mnist_resnet")
    entrypoint = smoke_entrypoint(document, mount="/tmp/runs")
    assert " --storage-is-shared" in entrypoint
    entrypoint = entrypoint.replace(" --storage-is-shared", "")
    submitted = submit(container_cluster, "node-local", entrypoint, smoke_runtime_env(document))
    assert submitted.status == "FAILED", submitted.output[-4000:]
    said = " ".join(submitted.output.split())  # the message, whatever the console's wrapping
    assert "storage path '/tmp/runs' is on this node's own disk" in said, said[-4000:]
    assert "but the Ray cluster has 3 nodes" in said, said[-4000:]
    assert "Set --storage-path to storage every node shares" in said, said[-4000:]
