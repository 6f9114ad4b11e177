"""The RayJob this pipeline ships runs its data work on a CPU-only node group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

MANIFEST = Path(__file__).resolve().parents[3] / "deploy" / "rayjob" / "mnist_resnet.yaml"


def rayjob() -> dict[str, Any]:
    if not MANIFEST.is_file():
        pytest.skip(f"no {MANIFEST} beside this copy of the pipeline")
    return next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "RayJob")


def test_the_job_decodes_on_its_cpu_only_group_by_node_labels() -> None:
    """Each group carries a Ray node label (a group's top-level `labels`: KubeRay rejects
    `rayStartParams['labels']`), and PLACEMENT_ARGS selects the GPU group for the training
    workers and the CPU-only group for Ray Data's tasks
    (test_a_lost_ingest_node_is_waited_for_then_a_run_left_without_one_stops_and_continues, in
    `nox -s faults`, runs that shape on this box); the GPU pod's CPUs all go to its worker; every mid-epoch loss is bounded
    by --checkpoint-every-minutes."""
    spec = rayjob()["spec"]
    groups = {g["groupName"]: g for g in spec["rayClusterSpec"]["workerGroupSpecs"]}
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    placement = env["PLACEMENT_ARGS"].split()
    cpus = placement[placement.index("--cpus-per-worker") + 1]
    train = placement[placement.index("--train-node-labels") + 1]
    ingest_labels = placement[placement.index("--ingest-node-labels") + 1]
    assert "$PLACEMENT_ARGS" in spec["entrypoint"]
    assert "--checkpoint-every-minutes" in spec["entrypoint"]
    gpu, ingest = groups["gpu"], groups["ingest"]
    assert "=".join(*gpu["labels"].items()) == train
    assert "=".join(*ingest["labels"].items()) == ingest_labels
    assert not any("labels" in group["rayStartParams"] for group in groups.values())
    assert gpu["rayStartParams"]["num-cpus"] == cpus
    [gpu_container] = gpu["template"]["spec"]["containers"]
    assert gpu_container["resources"]["limits"]["cpu"] == cpus
    [ingest_container] = ingest["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in ingest_container["resources"]["limits"]
