"""Pure checks: facts gathered from the nodes → rows of the table. No Ray here, so each is tested
without a cluster."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from raytrain_common.doctor.report import (
    FAIL,
    OK,
    SHM_MIN_GPU_BYTES,
    STORAGE_MIN_FREE_BYTES,
    TEMP_MIN_FREE_BYTES,
    WARN,
    GiB,
    Report,
    joined,
    short,
)


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


AUTH_FIX = (
    "start every node with token authentication: `ray get-auth-token --generate` once, then the "
    "same token on every node and client (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN, or "
    "RAY_AUTH_TOKEN_PATH); on KubeRay set spec.rayClusterSpec.authOptions.mode: token (every "
    "deploy/rayjob/*.yaml does). Without it anyone who reaches the GCS (6379), dashboard (8265) "
    "or client port (10001) can run code with the cluster's credentials"
)


def check_auth(report: Report, facts: dict[str, dict[str, Any]], dashboard: str | None) -> None:
    """Token authentication: OK on every node; WARN off on one node that serves on loopback only;
    FAIL off on a multi-node cluster, or with the dashboard (`host:port`) beyond loopback."""
    modes = {node_id: f.get("auth_mode") for node_id, f in facts.items()}
    where = f"dashboard at {dashboard}" if dashboard else "no dashboard"
    off = sorted(short(node_id) for node_id, mode in modes.items() if mode != "token")
    if not off:
        report.add("authentication", "cluster", OK, f"token on all {len(modes)} node(s); {where}")
        return
    state = "off" if len(off) == len(modes) else "off on " + ", ".join(off)
    value = f"{state} ({len(modes)} node(s)); {where}"
    exposed = dashboard is not None and not is_loopback(dashboard)
    if len(modes) > 1 or exposed:
        reason = (
            "other machines reach this cluster"
            if len(modes) > 1
            else "the dashboard listens beyond loopback"
        )
        report.add("authentication", "cluster", FAIL, f"{value}: {reason}", AUTH_FIX)
    else:
        report.add("authentication", "cluster", WARN, value, AUTH_FIX)


def check_versions(
    report: Report, facts: dict[str, dict[str, Any]], driver: dict[str, Any]
) -> None:
    def describe(f: dict[str, Any]) -> dict[str, str]:
        seen = {"python": f["python"], "ray": f["ray"], "torch": str(f.get("torch"))}
        seen.update({name: str(version) for name, version in f["packages"].items()})
        if f.get("gpus"):
            seen.update(CUDA=str(f.get("cuda")), NCCL=str(f.get("nccl")))
        return seen

    reference = describe(driver)
    # The driver (often a CPU-only head) sets the reference for all but the GPU stack, which the
    # GPU nodes must agree on among themselves.
    gpu_nodes = [describe(f) for f in facts.values() if f.get("gpus")]
    for name in ("CUDA", "NCCL"):
        if gpu_nodes:
            reference[name] = Counter(seen[name] for seen in gpu_nodes).most_common(1)[0][0]
    report.add("versions", "driver", OK, joined(reference))
    for node_id, node_facts in facts.items():
        seen = describe(node_facts)
        differ = {name: value for name, value in seen.items() if reference.get(name) != value}
        if differ:
            wrong = ", ".join(
                f"{name} {value} (elsewhere: {reference.get(name, 'none')})"
                for name, value in differ.items()
            )
            report.add(
                "versions",
                short(node_id),
                FAIL,
                f"differs: {wrong}",
                "run one image on every node (the same deploy/Dockerfile build for head and "
                "workers); a package missing or older on one node comes from a per-node install "
                "or a runtime_env: install it in the image instead",
            )
        else:
            report.add("versions", short(node_id), OK, "the same")


def check_imports(report: Report, facts: dict[str, dict[str, Any]], modules: Sequence[str]) -> None:
    if not modules:
        return
    for node_id, node_facts in facts.items():
        failed = {m: e for m, e in node_facts["imports"].items() if e and m in modules}
        if failed:
            detail = "; ".join(f"{module}: {error}" for module, error in failed.items())
            report.add(
                "imports",
                short(node_id),
                FAIL,
                detail[:400],
                f"install {', '.join(sorted(failed))} in the image every node runs "
                "(deploy/Dockerfile), or add the package to the job's runtime_env pip list",
            )
        else:
            report.add("imports", short(node_id), OK, ", ".join(modules))


def check_object_store_fits_shm(
    report: Report, node: str, shm: int | None, store: float | None
) -> None:
    """Ray keeps its object store in /dev/shm only when it fits there; otherwise it maps it from
    a file under /tmp (its log says "This will harm performance"): every object a worker or a
    Ray Data task passes then goes through the disk, and counts against the pod's ephemeral
    storage."""
    if not shm or not store:
        return
    value = f"object store {store / GiB:.1f} GiB, /dev/shm {shm / GiB:.1f} GiB"
    if store > shm:
        report.add(
            "object store",
            node,
            WARN,
            value + ": Ray puts the store on disk (/tmp)",
            "set the node's object-store-memory below the /dev/shm size (rayStartParams "
            "object-store-memory, as deploy/rayjob does) or mount a larger memory-backed /dev/shm",
        )
    else:
        report.add("object store", node, OK, value)


LAUNCHER_FIX = (
    "unset them where the node starts (its shell profile, the pod's env, a launcher such as "
    "deepspeed or torchrun around `ray start`): Ray Train sets them for each worker, and code "
    "that reads them before it does joins a process group that is not the run's"
)


def check_launcher_variables(
    report: Report, facts: dict[str, dict[str, Any]], driver: dict[str, Any]
) -> None:
    """Rendezvous variables (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE) set by hand or by a
    launcher: FAIL in the driver (train refuses to start there), WARN on a node."""
    where = {"driver": driver, **{short(node_id): f for node_id, f in facts.items()}}
    for place, f in where.items():
        found = f.get("launcher_variables") or {}
        if found:
            value = ", ".join(f"{name}={value}" for name, value in found.items())
            report.add("launcher variables", place, FAIL if place == "driver" else WARN, value,
                       LAUNCHER_FIX)  # fmt: skip
    if not any(f.get("launcher_variables") for f in where.values()):
        report.add("launcher variables", "cluster", OK, "none set: Ray Train sets them")


def check_system(report: Report, facts: dict[str, dict[str, Any]]) -> None:
    shape = report.shape
    for node_id, f in facts.items():
        node = short(node_id)
        shm = f.get("shm_total")
        if shm is None:
            report.add("/dev/shm", node, WARN, "absent", "mount a memory-backed /dev/shm")
        elif shm < SHM_MIN_GPU_BYTES:
            report.add(
                "/dev/shm",
                node,
                FAIL if shape.use_gpu else WARN,
                f"{shm / GiB:.2f} GiB",
                "mount a memory-backed emptyDir (medium: Memory) at /dev/shm, as the manifests in "
                "deploy/rayjob do, or run docker with --shm-size=8g: NCCL and Ray's object store "
                "need more than a container's default 64 MiB",
            )
        else:
            report.add("/dev/shm", node, OK, f"{shm / GiB:.1f} GiB")
        check_object_store_fits_shm(report, node, shm, f.get("object_store_memory"))
        for path, free in f["disk_free"].items():
            is_storage = path == shape.storage_path
            floor = STORAGE_MIN_FREE_BYTES if is_storage else TEMP_MIN_FREE_BYTES
            what = "storage disk" if is_storage else "temp disk"
            value = f"{free / GiB:.1f} GiB free at {path}"
            if free < floor:
                report.add(
                    what,
                    node,
                    FAIL if free < GiB else WARN,
                    value,
                    f"free space or give the node a larger disk (at least {floor // GiB} GiB): "
                    "checkpoints, Ray's object spilling and runtime envs are written here",
                )
            else:
                report.add(what, node, OK, value)
        total, available = f["memory_total"], f["memory_available"]
        value = f"{available / GiB:.1f} of {total / GiB:.1f} GiB available"
        if available < 2 * GiB:
            report.add(
                "memory",
                node,
                WARN,
                value,
                "workers on this node may be OOM-killed: give "
                "the node more memory or run fewer workers on it",
            )
        else:
            report.add("memory", node, OK, value)
