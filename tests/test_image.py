"""The image every RayJob names, built here, and each pipeline run in it as Kubernetes runs a pod.

`tools/build_image.py` builds deploy/Dockerfile, unchanged, on a stand-in for Ray's base image
(Docker Hub is out of reach here: deploy/standin/Containerfile, Debian's Python 3.11, the `ray`
user, ray[default,train,data]==2.60.0). Each container then runs as the RayJobs' pods do: uid 1000
and group 100, a read-only root file system with a writable /tmp, /dev/shm in memory, every
capability dropped, no privilege escalation, the shared volume at /mnt/runs. podman needs runc and
two ulimits set on this box (crun refuses its hybrid cgroups; runc the default limits).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raytrain_testkit.console import console_noise
from raytrain_testkit.pace import paced

pytestmark = pytest.mark.manifests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from build_image import PODMAN, ULIMITS, pod_flags  # noqa: E402  (tools/ is not a package)


def head_pod_flags() -> list[str]:
    """How mnist's RayJob runs its head pod, read from the manifest (tools/build_image.pod_flags):
    uid 1000, a read-only root, /tmp and /dev/shm its only writable places besides the volume."""
    text = (ROOT / "deploy" / "rayjob" / "mnist_resnet.yaml").read_text()
    document = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "RayJob")
    pod = document["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    return pod_flags(pod, pod["containers"][0])


def in_pod(image: str, volume: Path, command: str) -> str:
    """`command` (bash) in a container of `image` run as a RayJob pod; its console, which must
    carry none of the lines only --verbose may show."""
    podman = [*PODMAN, "run", "--rm", *ULIMITS, *head_pod_flags(), "-v", f"{volume}:/mnt/runs"]
    done = subprocess.run(
        [*podman, image, "bash", "-c", command], capture_output=True, text=True, timeout=paced(600)
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert console_noise(output) == [], output[-4000:]
    return output


def test_each_pipeline_runs_in_its_image_as_a_pod_runs_it(image: str, tmp_path: Path) -> None:
    """--help of the three commands, then each pipeline's prepare of a user's data (its own
    local Ray cluster in the pod) and mnist's short train after it, in containers whose root file
    system is read-only: the outputs land on the shared volume, owned by uid 1000. Each pipeline
    trains in the image on the cluster of containers (tests/test_container_cluster.py, the same
    pod settings), so one train here proves the single-pod path without running the three trainings twice."""
    volume = tmp_path / "runs"
    volume.mkdir()
    volume.chmod(0o777)  # the pod's uid 1000 writes here; CI runs as root
    rows = ["text,label"] + [
        f"the food was {w} today {i},{w}" for i in range(60) for w in ("great", "cold")
    ]
    (volume / "reviews.csv").write_text("\n".join(rows) + "\n")
    corpus = volume / "corpus"
    corpus.mkdir()
    for page in sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("pipelines/*/README.md")]):
        (corpus / f"{page.parent.name}-{page.name}").write_text(page.read_text())

    helps = in_pod(image, volume, "mnist-resnet --help && hf-finetune --help && llm-fsdp --help")
    for program in ("mnist-resnet", "hf-finetune", "llm-fsdp"):
        assert f"usage: {program} " in helps

    at = "--storage-path /mnt/runs"
    in_pod(
        image,
        volume,
        f"mnist-resnet prepare {at} && mnist-resnet train --preset cpu {at} --epochs 1 "
        "--limit-train-rows 512 --limit-val-rows 256 --limit-test-rows 256 --global-batch-size 128 "
        "--model-width 16",
    )
    in_pod(
        image,
        volume,
        f"hf-finetune prepare {at} --dataset /mnt/runs/reviews.csv && "
        f"llm-fsdp prepare {at} --dataset /mnt/runs/corpus --tokenizer bpe:512 --seq-len 64",
    )
    summary = volume / "mnist_resnet" / "summary.json"
    assert json.loads(summary.read_text())["steps_done"] >= 4
    assert summary.stat().st_uid == 1000
    for prepared in ("text_classification", "llm"):  # their default folders under data/
        written = volume / "data" / prepared / "dataset.json"
        assert json.loads(written.read_text()), prepared
        assert written.stat().st_uid == 1000, prepared
