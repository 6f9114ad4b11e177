"""Build deploy/Dockerfile's image on this machine, with podman, on a stand-in for Ray's base image.

    python tools/build_image.py [--tag localhost/raytrain-pipelines:test] [--rebuild-base]

Ray's image (rayproject/ray:2.60.0-py311-gpu) comes from Docker Hub, which this project's CI cannot
reach; the image the RayJobs name is built here in three layers of images, each reused when it
exists, so a code change rebuilds only the last:

1. `localhost/raytrain-debian:bookworm`: Debian bookworm's minimal root file system (debootstrap
   from Debian's own mirror, root needed), imported once per machine;
2. `localhost/raytrain-standin-base:ray2.60.0-py311`: deploy/standin/Containerfile on it (Python
   3.11, the `ray` user, ray[default,train,data]==2.60.0), once per machine;
3. the project's image: deploy/Dockerfile, unchanged, with BASE_IMAGE set to the stand-in; podman's
   layer cache keeps its pip layer until the Dockerfile's pins change.

Builds one at a time on a machine: a second invocation waits for the first (a lock file in the
temporary folder) and then finds its images, so CI can start a build in the background while the
tests run and the image test's own call finds it done. Prints each step's seconds and the image's
size. podman runs with runc and two ulimits: crun refuses this box's hybrid cgroups, and runc
refuses the default RLIMIT_NOFILE/NPROC. pip in the build trusts this machine's certificate
authorities (an egress proxy's CA, as on the CI box): the host's bundle and a pip.conf naming it
are mounted into each RUN step, never into a layer.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEBIAN = "localhost/raytrain-debian:bookworm"
STANDIN_BASE = "localhost/raytrain-standin-base:ray2.60.0-py311"
IMAGE = "localhost/raytrain-pipelines:test"
MIRROR = "http://deb.debian.org/debian"
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"  # Debian's bundle, with any CA the admin added
HOST_CA_MOUNT = "/run/host-ca-certificates.crt"
PODMAN = ["podman", "--runtime", "runc"]
# Set, or runc refuses the defaults here; nproc counts every thread of the uid over all containers
# (Ray starts dozens per process: 1,024 ran out with a 3-node cluster of containers).
ULIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]


def pod_flags(pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
    """`podman run` flags that run a container as a RayJob manifest's pod runs it, read from the
    manifest itself so the tests that run the image cannot drift from what ships: the pod's and
    the container's securityContext (uid and gid, read-only root, capabilities, no privilege
    escalation) and every emptyDir the container mounts (/tmp, /dev/shm), which are all it may
    write besides the shared volume (mounted by the caller). KubeRay's wait-gcs-ready init
    container copies the Ray container's securityContext and volumeMounts (KubeRay v1.7.0,
    ray-operator/controllers/ray/common/pod.go), so it runs the same way. An emptyDir on the
    node's disk is a tmpfs here (this box has no per-container disk quota); the size limits are
    the manifest's."""
    context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    flags = ["--user", f"{context['runAsUser']}:{context.get('runAsGroup', 0)}"]
    if context.get("readOnlyRootFilesystem"):
        # podman adds writable tmpfs at /tmp, /var/tmp and /run to a read-only root unless told
        # not to: only the manifest's own mounts may be writable, as on Kubernetes.
        flags += ["--read-only", "--read-only-tmpfs=false"]
    if "ALL" in context.get("capabilities", {}).get("drop", []):
        flags += ["--cap-drop", "ALL"]
    if context.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        empty_dir = volumes[mount["name"]].get("emptyDir")
        if empty_dir is None:
            continue  # the shared volume: the caller's to mount
        size = str(empty_dir.get("sizeLimit", "1Gi")).replace("Gi", "g").replace("Mi", "m")
        if mount["mountPath"] == "/dev/shm":
            flags += ["--shm-size", size]
        else:
            flags += ["--tmpfs", f"{mount['mountPath']}:rw,size={size},mode=1777"]
    return flags


def image_exists(tag: str) -> bool:
    return subprocess.run(["podman", "image", "exists", tag], check=False).returncode == 0


def image_size_mb(tag: str) -> float:
    out = subprocess.run(
        ["podman", "image", "inspect", tag], check=True, capture_output=True, text=True
    ).stdout
    return float(json.loads(out)[0]["Size"]) / 2**20


def build_debian(tag: str) -> None:
    """Debian bookworm's minbase root file system, imported as an image."""
    with tempfile.TemporaryDirectory(prefix="raytrain-rootfs-") as folder:
        rootfs = Path(folder) / "rootfs"
        debootstrap = ["debootstrap", "--variant=minbase", "bookworm", str(rootfs), MIRROR]
        subprocess.run(debootstrap, check=True, stdout=subprocess.DEVNULL)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "-", tag], stdin=tar.stdout, check=True)
        if tar.wait() != 0:
            raise RuntimeError(f"tar of {rootfs} failed")


def build(tag: str, containerfile: Path, context: Path, build_args: dict[str, str]) -> None:
    args = [f"--build-arg={name}={value}" for name, value in build_args.items()]
    with tempfile.TemporaryDirectory(prefix="raytrain-build-") as folder:
        pip_conf = Path(folder) / "pip.conf"
        pip_conf.write_text(f"[global]\ncert = {HOST_CA_MOUNT}\n")
        mounts = [f"--volume={HOST_CA}:{HOST_CA_MOUNT}:ro", f"--volume={pip_conf}:/etc/pip.conf:ro"]
        command = [*PODMAN, "build", *ULIMITS, *mounts, *args, "-f", str(containerfile), "-t", tag]
        subprocess.run([*command, str(context)], check=True)


def timed(what: str, step: object, *args: object) -> float:
    started = time.perf_counter()
    step(*args)  # type: ignore[operator]
    seconds = time.perf_counter() - started
    print(f"{what}: {seconds:.1f} s", flush=True)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=IMAGE, help=f"the project's image (default: {IMAGE})")
    parser.add_argument("--rebuild-base", action="store_true", help="build the stand-in anew")
    args = parser.parse_args(argv)
    missing = [tool for tool in ("podman", "debootstrap") if shutil.which(tool) is None]
    if missing:
        print(
            f"build_image: {' and '.join(missing)} not found: apt-get install podman buildah runc "
            "debootstrap (as root)",
            file=sys.stderr,
        )
        return 2
    # Held, open, until this process ends: a second build waits here for the first.
    lock = (Path(tempfile.gettempdir()) / "raytrain-build-image.lock").open("w")
    started = time.perf_counter()
    fcntl.flock(lock, fcntl.LOCK_EX)
    if (waited := time.perf_counter() - started) > 1:
        print(f"waited {waited:.0f} s for another build", flush=True)
    if args.rebuild_base or not image_exists(DEBIAN):
        timed(f"{DEBIAN} (debootstrap)", build_debian, DEBIAN)
    if args.rebuild_base or not image_exists(STANDIN_BASE):
        containerfile = ROOT / "deploy" / "standin" / "Containerfile"
        timed(
            STANDIN_BASE,
            build,
            STANDIN_BASE,
            containerfile,
            containerfile.parent,
            {"DEBIAN_ROOTFS": DEBIAN},
        )
    timed(
        args.tag,
        build,
        args.tag,
        ROOT / "deploy" / "Dockerfile",
        ROOT,
        {"BASE_IMAGE": STANDIN_BASE},
    )
    print(f"{args.tag}: {image_size_mb(args.tag):,.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
