"""The RayJob this pipeline ships runs its data work on a CPU-only node group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

MANIFEST = Path(__file__).resolve().parents[3] / "deploy" / "rayjob" / "mnist_resnet.yaml"


def rayjob() -> dict[str, Any]:
    if not MANIFEST.is_file():
        pytest.skip(f"no {MANIFEST} beside this copy of the pipeline")
    return next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "RayJob")


def test_the_job_decodes_on_its_cpu_only_group() -> None:
    """The training workers take all of their GPU pod's CPUs and its "trainer" resource, which only
    the GPU group declares; a CPU-only group is then where Ray Data's tasks can run
    (test_cpu_only_nodes_decode_while_the_training_node_trains runs that shape on this box)."""
    spec = rayjob()["spec"]
    groups = {g["groupName"]: g for g in spec["rayClusterSpec"]["workerGroupSpecs"]}
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    placement = env["PLACEMENT_ARGS"].split()
    cpus = placement[placement.index("--cpus-per-worker") + 1]
    resource = placement[placement.index("--worker-resource") + 1]
    assert "$PLACEMENT_ARGS" in spec["entrypoint"]
    gpu, ingest = groups["gpu"], groups["ingest"]
    assert gpu["rayStartParams"]["num-cpus"] == cpus
    assert json.loads(json.loads(gpu["rayStartParams"]["resources"])) == {resource: 1}
    [gpu_container] = gpu["template"]["spec"]["containers"]
    assert gpu_container["resources"]["limits"]["cpu"] == cpus
    assert "resources" not in ingest["rayStartParams"]
    [ingest_container] = ingest["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in ingest_container["resources"]["limits"]
