"""`raytrain-doctor`: check a Ray cluster for a run before the run, in about half a minute.

Every check is done for real on the cluster at RAY_ADDRESS (or a local one): a task pinned to each
node reports its versions, imports, /dev/shm, disks and memory; the storage path is written from every
node, read back from another, listed and deleted; a worker group of the run's shape runs a timed
all-reduce (gloo on CPUs, NCCL on GPUs); and the pipeline's model is forecast at the run's micro-batch.
Each row is OK, WARN or FAIL with what was measured, and every row that is not OK says what to change.
The exit status is 0 only when nothing FAILs; `--json FILE` writes the table for machines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

OK, WARN, FAIL = "OK", "WARN", "FAIL"
GiB = 2**30
PROBE_TIMEOUT_S = 120.0
COMMON_DISTRIBUTION = "raytrain-common"
SHM_MIN_GPU_BYTES = 1 * GiB  # NCCL's shared-memory transport and DataLoader workers
TEMP_MIN_FREE_BYTES = 5 * GiB  # Ray spills objects and unpacks runtime envs under its temp folder
STORAGE_MIN_FREE_BYTES = 10 * GiB
COLLECTIVE_CAUSES = (
    "ports closed between the nodes (torch.distributed's TCP store and gloo/NCCL use random ports), "
    "the wrong network interface (set NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME to the one the nodes "
    "share, e.g. eth0), InfiniBand not set up (NCCL_DEBUG=INFO shows it; NCCL_IB_HCA, or "
    "NCCL_IB_DISABLE=1 without it), or a rank stuck on an overloaded node"
)


@dataclass
class Row:
    check: str
    node: str
    status: str
    value: str
    fix: str = ""


@dataclass
class Shape:
    """The worker group and storage the run will ask for."""

    num_workers: int = 2
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    placement_strategy: str = "PACK"
    accelerator_type: str | None = None
    storage_path: str = "./runs"
    storage_is_shared: bool = False

    @property
    def use_gpu(self) -> bool:
        return self.gpus_per_worker > 0

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            bundle["GPU"] = self.gpus_per_worker
        return bundle


@dataclass
class Report:
    shape: Shape
    rows: list[Row] = field(default_factory=list)

    def add(self, check: str, node: str, status: str, value: str, fix: str = "") -> None:
        self.rows.append(Row(check, node, status, value, fix))

    @property
    def failed(self) -> bool:
        return any(row.status == FAIL for row in self.rows)

    def counts(self) -> Counter[str]:
        return Counter(row.status for row in self.rows)


# ---------------------------------------------------------------------------------------------
# What runs on each node
# ---------------------------------------------------------------------------------------------


def probe_node(
    distributions: Sequence[str], modules: Sequence[str], paths: Sequence[str]
) -> dict[str, Any]:
    """Versions, imports, GPUs, /dev/shm, free disk and memory of the node this runs on."""
    import importlib
    import importlib.metadata
    import platform
    import shutil
    import socket
    import tempfile

    import ray

    facts: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "packages": {},
        "imports": {},
        "disk_free": {},
    }
    for name in distributions:
        try:
            facts["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            facts["packages"][name] = None
    for module in modules:
        try:
            importlib.import_module(module)
            facts["imports"][module] = None
        except Exception as error:  # any failure to import is what this check reports
            facts["imports"][module] = f"{type(error).__name__}: {error}"
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["cuda"] = torch.version.cuda
        facts["gpus"] = []
        if torch.cuda.is_available():
            nccl = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
            for index in range(torch.cuda.device_count()):
                properties = torch.cuda.get_device_properties(index)
                facts["gpus"].append({"name": properties.name, "memory": properties.total_memory})
    except ImportError as error:
        facts["torch"] = None
        facts["imports"]["torch"] = f"ImportError: {error}"
    devices = set()
    for path in (*paths, tempfile.gettempdir(), "/tmp/ray"):
        existing = path
        while existing and not os.path.exists(existing):
            existing = os.path.dirname(existing.rstrip("/"))
        if existing and os.stat(existing).st_dev not in devices:  # one row per disk
            devices.add(os.stat(existing).st_dev)
            facts["disk_free"][path] = shutil.disk_usage(existing).free
    facts["auth_mode"] = _auth_mode()
    facts["shm_total"] = shutil.disk_usage("/dev/shm").total if os.path.exists("/dev/shm") else None
    facts["memory_total"], facts["memory_available"] = _memory()
    return facts


def _auth_mode() -> str | None:
    """This process's Ray authentication mode ("token" or "disabled"): a task's is its node's, as
    a worker inherits its raylet's environment."""
    try:
        from ray._private.authentication.authentication_utils import get_authentication_mode_name
        from ray._raylet import get_authentication_mode

        return str(get_authentication_mode_name(get_authentication_mode()))
    except ImportError:  # a Ray without token authentication (< 2.52)
        return None


def dashboard_address() -> str | None:
    """host:port the cluster's dashboard (and Jobs API) serves on, as it registered in the GCS: a
    loopback host when it listens on loopback only, else the node's address."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    value = _internal_kv_get(
        ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD
    )
    return value.decode() if value else None


def _is_loopback(address: str) -> bool:
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
    value = f"{'off' if len(off) == len(modes) else 'off on ' + ', '.join(off)} ({len(modes)} node(s)); {where}"
    exposed = dashboard is not None and not _is_loopback(dashboard)
    if len(modes) > 1 or exposed:
        reason = (
            "other machines reach this cluster"
            if len(modes) > 1
            else "the dashboard listens beyond loopback"
        )
        report.add("authentication", "cluster", FAIL, f"{value}: {reason}", AUTH_FIX)
    else:
        report.add("authentication", "cluster", WARN, value, AUTH_FIX)


def _memory() -> tuple[int, int]:
    """(total, available) bytes of this node's memory, honouring a container's cgroup limit."""
    info = {}
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            with open(limit_file, encoding="ascii") as f:
                limit_text = f.read().strip()
            with open(usage_file, encoding="ascii") as f:
                usage = int(f.read().strip())
        except OSError:
            continue
        if limit_text != "max" and int(limit_text) < total:
            total = int(limit_text)
            available = min(available, total - usage)
        break
    return total, available


def storage_round(
    uri: str, folder: str, node_id: str, step: str, nodes: Sequence[str]
) -> dict[str, Any]:
    """One node's part of the storage check: write its file, or read and list the others', or delete."""
    from raytrain_common.storage import resolve_storage

    result: dict[str, Any] = {"error": None}
    try:
        probe = resolve_storage(uri).join(folder)
        mine = probe.join(node_id)
        if step == "write":
            probe.mkdir()
            mine.write_text(node_id)
        elif step == "read":
            listed = {file.path.rsplit("/", 1)[-1] for file in probe.list_files()}
            result["listed"] = sorted(listed)
            others = [node for node in nodes if node != node_id]
            if others:
                neighbour = others[(sorted(nodes).index(node_id)) % len(others)]
                result["read_from"] = neighbour
                try:
                    result["read_ok"] = probe.join(neighbour).read_text() == neighbour
                except FileNotFoundError:  # written there, not here: not shared
                    result["read_ok"] = False
        elif step == "delete":
            mine.filesystem.delete_file(mine.path)
    except Exception as error:  # each node's failure is a row of the report, not a crash
        result["error"] = f"{type(error).__name__}: {error}"
    return result


class CollectiveRank:
    """One rank of the doctor's worker group (a Ray actor placed like a training worker)."""

    def address(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(
        self, rank: int, world: int, init_method: str, backend: str, size_mb: int, timeout_s: float
    ) -> dict[str, Any]:
        import datetime
        import statistics

        import torch
        import torch.distributed as dist

        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=max(1.0, timeout_s)),
        )  # fmt: skip
        try:
            values = torch.full((1 << 16,), float(rank + 1), device=device)
            dist.all_reduce(values)
            expected = world * (world + 1) / 2
            correct = bool(torch.all(values == expected).item())

            tiny = torch.ones(1, device=device)
            for _ in range(3):
                dist.all_reduce(tiny)
            latencies = []
            for _ in range(20):
                _sync(device)
                start = time.perf_counter()
                dist.all_reduce(tiny)
                _sync(device)
                latencies.append(time.perf_counter() - start)

            payload = torch.ones(size_mb * 2**20 // 4, device=device)
            dist.all_reduce(payload)
            _sync(device)
            start = time.perf_counter()
            repeats = 3
            for _ in range(repeats):
                dist.all_reduce(payload)
            _sync(device)
            seconds = (time.perf_counter() - start) / repeats
            # Bus bandwidth as nccl-tests defines it: each rank sends and receives 2(n-1)/n of the data.
            bus_gbps = payload.numel() * 4 * 2 * (world - 1) / world / seconds / 1e9
            return {
                "correct": correct,
                "latency_us": statistics.median(latencies) * 1e6,
                "bus_gbps": bus_gbps,
            }
        finally:
            dist.destroy_process_group()


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# The checks, run from the driver
# ---------------------------------------------------------------------------------------------


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [node for node in ray.nodes() if node.get("Alive")]


def short(node_id: str) -> str:
    return node_id[:8]


def on_node(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def probe_nodes(
    report: Report,
    nodes: list[dict[str, Any]],
    distributions: Sequence[str],
    modules: Sequence[str],
) -> dict[str, dict[str, Any]]:
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(probe_node)
    paths = [report.shape.storage_path] if _is_local(report.shape.storage_path) else []
    pending = {
        node["NodeID"]: task.options(scheduling_strategy=on_node(node["NodeID"])).remote(
            list(distributions), list(modules), paths
        )
        for node in nodes
    }
    facts: dict[str, dict[str, Any]] = {}
    stores = {
        node["NodeID"]: node.get("Resources", {}).get("object_store_memory") for node in nodes
    }
    for node_id, ref in pending.items():
        try:
            facts[node_id] = ray.get(ref, timeout=PROBE_TIMEOUT_S)
            facts[node_id]["object_store_memory"] = stores[node_id]
        except Exception as error:
            report.add(
                "node answers", short(node_id), FAIL, f"{type(error).__name__}: {error}"[:300],
                "the node is listed alive but runs no task: check its raylet log "
                "(/tmp/ray/session_latest/logs/raylet.out on that node) and that it is not out of "
                "memory or disk",
            )  # fmt: skip
    return facts


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
    report.add("versions", "driver", OK, _join(reference))
    for node_id, node_facts in facts.items():
        seen = describe(node_facts)
        differ = {name: value for name, value in seen.items() if reference.get(name) != value}
        if differ:
            wrong = ", ".join(
                f"{name} {value} (elsewhere: {reference.get(name, 'none')})"
                for name, value in differ.items()
            )
            report.add(
                "versions", short(node_id), FAIL, f"differs: {wrong}",
                "run one image on every node (the same deploy/Dockerfile build for head and "
                "workers); a package missing or older on one node comes from a per-node install "
                "or a runtime_env: install it in the image instead",
            )  # fmt: skip
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
                "imports", short(node_id), FAIL, detail[:400],
                f"install {', '.join(sorted(failed))} in the image every node runs "
                "(deploy/Dockerfile), or add the package to the job's runtime_env pip list",
            )  # fmt: skip
        else:
            report.add("imports", short(node_id), OK, ", ".join(modules))


def check_resources(report: Report, nodes: list[dict[str, Any]], autoscaling: bool) -> None:
    import ray

    shape = report.shape
    bundle = shape.bundle()
    available = ray._private.state.available_resources_per_node()
    fits_total = 0
    for node in nodes:
        node_id = node["NodeID"]
        free = available.get(node_id, {})
        total = node.get("Resources", {})
        fits = min(
            math.floor(free.get(name, 0.0) / amount + 1e-9) for name, amount in bundle.items()
        )
        if shape.accelerator_type and f"accelerator_type:{shape.accelerator_type}" not in total:
            fits = 0
        fits_total += fits
        held = ", ".join(
            f"{name} {free.get(name, 0.0):g}/{total.get(name, 0.0):g} free"
            for name in ("CPU", "GPU")
            if total.get(name) or name in bundle
        )
        report.add(
            "resources", short(node_id), OK, f"{held}: {fits} worker(s) of {_bundle(bundle)} fit"
        )
    wanted = shape.num_workers
    summary = f"{min(fits_total, wanted)} of {wanted} worker(s) of {_bundle(bundle)} fit now"
    if shape.accelerator_type:
        summary += f" on {shape.accelerator_type} nodes"
    if fits_total >= wanted:
        report.add("resources", "cluster", OK, summary)
    elif autoscaling:
        report.add(
            "resources", "cluster", WARN, summary + "; the autoscaler must add the rest",
            "make sure the worker group's maxReplicas can hold the run, or lower --num-workers",
        )  # fmt: skip
    else:
        lower = (
            f"lower --num-workers to {fits_total}" if fits_total else "no node can hold one worker"
        )
        report.add(
            "resources", "cluster", FAIL, summary,
            f"{lower}: ask for fewer CPUs/GPUs per worker, add nodes (worker replicas) with "
            "them, or stop what holds them now (`ray status` lists it); the run would wait for "
            "resources for ever",
        )  # fmt: skip


def check_object_store_fits_shm(
    report: Report, node: str, shm: int | None, store: float | None
) -> None:
    """Ray keeps its object store in /dev/shm only when it fits there; otherwise it maps it from
    a file under /tmp (its log says "This will harm performance"): every object a worker or a
    Ray Data task passes then goes through the disk, and counts against the pod's ephemeral storage."""
    if not shm or not store:
        return
    value = f"object store {store / GiB:.1f} GiB, /dev/shm {shm / GiB:.1f} GiB"
    if store > shm:
        report.add(
            "object store", node, WARN, value + ": Ray puts the store on disk (/tmp)",
            "set the node's object-store-memory below the /dev/shm size (rayStartParams "
            "object-store-memory, as deploy/rayjob does) or mount a larger memory-backed /dev/shm",
        )  # fmt: skip
    else:
        report.add("object store", node, OK, value)


def check_system(report: Report, facts: dict[str, dict[str, Any]]) -> None:
    shape = report.shape
    for node_id, f in facts.items():
        node = short(node_id)
        shm = f.get("shm_total")
        if shm is None:
            report.add("/dev/shm", node, WARN, "absent", "mount a memory-backed /dev/shm")
        elif shm < SHM_MIN_GPU_BYTES:
            report.add(
                "/dev/shm", node, FAIL if shape.use_gpu else WARN, f"{shm / GiB:.2f} GiB",
                "mount a memory-backed emptyDir (medium: Memory) at /dev/shm, as the manifests in "
                "deploy/rayjob do, or run docker with --shm-size=8g: NCCL and Ray's object store "
                "need more than a container's default 64 MiB",
            )  # fmt: skip
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
                    what, node, FAIL if free < GiB else WARN, value,
                    f"free space or give the node a larger disk (at least {floor // GiB} GiB): "
                    "checkpoints, Ray's object spilling and runtime envs are written here",
                )  # fmt: skip
            else:
                report.add(what, node, OK, value)
        total, available = f["memory_total"], f["memory_available"]
        value = f"{available / GiB:.1f} of {total / GiB:.1f} GiB available"
        if available < 2 * GiB:
            report.add(
                "memory", node, WARN, value,
                "workers on this node may be OOM-killed: give the node more memory or run fewer "
                "workers on it",
            )  # fmt: skip
        else:
            report.add("memory", node, OK, value)


def check_storage(report: Report, nodes: list[dict[str, Any]]) -> None:
    import ray

    from raytrain_common.storage import StorageError, check_shared_for_cluster, resolve_storage

    shape = report.shape
    try:
        storage = resolve_storage(shape.storage_path)
    except StorageError as error:
        report.add("storage", "driver", FAIL, str(error), "give --storage-path a valid location")
        return
    uri = storage.uri
    node_ids = [node["NodeID"] for node in nodes]
    folder = f".raytrain-doctor-{uuid.uuid4().hex[:8]}"
    task = ray.remote(num_cpus=0, max_retries=0)(storage_round)

    def round_(step: str) -> dict[str, dict[str, Any]]:
        refs = {
            node_id: task.options(scheduling_strategy=on_node(node_id)).remote(
                uri, folder, node_id, step, node_ids
            )
            for node_id in node_ids
        }
        results = {}
        for node_id, ref in refs.items():
            try:
                results[node_id] = ray.get(ref, timeout=PROBE_TIMEOUT_S)
            except Exception as error:
                results[node_id] = {"error": f"{type(error).__name__}: {error}"[:300]}
        return results

    written = round_("write")
    read = round_("read")
    round_("delete")
    with contextlib.suppress(OSError):  # already gone, or a bucket where folders are prefixes
        storage.join(folder).filesystem.delete_dir(storage.join(folder).path)

    all_shared = True
    for node_id in node_ids:
        node = short(node_id)
        wrote, saw = written[node_id], read[node_id]
        if wrote["error"] or saw["error"]:
            all_shared = False
            report.add(
                "storage", node, FAIL, f"{uri}: {wrote['error'] or saw['error']}",
                "make the path writable from every node: mount the same volume at the same path "
                "on every pod, or give the credentials for the bucket to every pod",
            )  # fmt: skip
            continue
        missing = sorted(set(node_ids) - set(saw.get("listed", [])))
        neighbour_ok = saw.get("read_ok", True)
        if missing or not neighbour_ok:
            all_shared = False
            report.add(
                "storage", node, FAIL,
                f"{uri}: wrote its file, but sees no file from node(s) "
                f"{', '.join(map(short, missing)) or short(saw['read_from'])}",
                "this path is not shared: each node writes to its own disk, so checkpoints from "
                "workers on other nodes would be lost. Mount one shared volume (NFS / a "
                "ReadWriteMany PVC) at this path on every node, or use s3://bucket/prefix or "
                "gs://bucket/prefix",
            )  # fmt: skip
        else:
            read_from = saw.get("read_from")
            also = f", read node {short(read_from)}'s" if read_from else ""
            report.add(
                "storage", node, OK, f"{uri}: wrote{also}, listed {len(saw['listed'])}, deleted"
            )

    try:
        check_shared_for_cluster(storage, len(nodes), assume_shared=shape.storage_is_shared)
    except StorageError as error:
        seen = (
            "Every node did see the others' files here: if this is such a mount, "
            "--storage-is-shared is safe."
            if all_shared
            else "The nodes did not see each other's files: the path is node-local."
        )
        problem, fix = str(error).split(": ", 1)
        report.add("storage shared", "cluster", FAIL, problem, f"{fix} {seen}")
        return
    if len(nodes) > 1 and all_shared:
        report.add("storage shared", "cluster", OK, f"every node sees every node's files at {uri}")
    elif len(nodes) == 1:
        report.add("storage shared", "cluster", OK, "one node: nothing to share")


def check_collective(report: Report, timeout_s: float, size_mb: int | None, backend: str) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    shape = report.shape
    world = shape.num_workers
    backend = backend if backend != "auto" else ("nccl" if shape.use_gpu else "gloo")
    size_mb = size_mb or (256 if backend == "nccl" else 16)
    group = placement_group([shape.bundle()] * world, strategy=shape.placement_strategy)
    try:
        ray.get(group.ready(), timeout=min(60.0, max(10.0, timeout_s)))
    except Exception:
        remove_placement_group(group)
        report.add(
            "collective", "cluster", FAIL, f"the {world} worker(s) of {_bundle(shape.bundle())} "
            f"({shape.placement_strategy}) could not be placed",
            "see the resources rows: the run could not start its worker group either",
        )  # fmt: skip
        return
    rank_class = ray.remote(CollectiveRank)
    ranks = [
        rank_class.options(
            num_cpus=shape.cpus_per_worker,
            num_gpus=shape.gpus_per_worker if shape.use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index
            ),
        ).remote()
        for index in range(world)
    ]
    try:
        host, port = ray.get(ranks[0].address.remote(), timeout=PROBE_TIMEOUT_S)
        nodes = len(set(ray.get([rank.node.remote() for rank in ranks], timeout=PROBE_TIMEOUT_S)))
        start = time.monotonic()
        refs = [
            rank.run.remote(index, world, f"tcp://{host}:{port}", backend, size_mb, timeout_s)
            for index, rank in enumerate(ranks)
        ]
        _, not_ready = ray.wait(refs, num_returns=world, timeout=timeout_s)
        elapsed = time.monotonic() - start
        if not_ready:
            report.add(
                "collective", "cluster", FAIL,
                f"{backend}, {world} ranks: {len(not_ready)} rank(s) had not finished the "
                f"all-reduce after {timeout_s:g} s (the run would hang, then time out)",
                f"likely causes: {COLLECTIVE_CAUSES}",
            )  # fmt: skip
            return
        results = ray.get(refs)
    except Exception as error:
        report.add(
            "collective", "cluster", FAIL, f"{backend}: {type(error).__name__}: {error}"[:400],
            f"likely causes: {COLLECTIVE_CAUSES}",
        )  # fmt: skip
        return
    finally:
        for rank in ranks:
            ray.kill(rank)
        remove_placement_group(group)
    correct = all(result["correct"] for result in results)
    latency = max(result["latency_us"] for result in results)
    bandwidth = min(result["bus_gbps"] for result in results)
    value = (
        f"{backend}, {world} rank(s) on {nodes} node(s): all-reduce {'correct' if correct else 'WRONG'}, latency "
        f"{latency:.0f} µs, bus bandwidth {bandwidth:.2f} GB/s ({size_mb} MiB), in {elapsed:.1f} s"
    )
    if not correct:
        report.add(
            "collective", "cluster", FAIL, value,
            "the ranks disagree on a sum: mixed NCCL/CUDA versions or a faulty GPU or link; "
            "compare the versions rows and run NCCL's all_reduce_perf on the nodes",
        )  # fmt: skip
    elif backend == "nccl" and world > 1 and bandwidth < 1.0:
        report.add(
            "collective", "cluster", WARN, value,
            "NCCL is slower than 1 GB/s, i.e. on TCP sockets: check InfiniBand / EFA with "
            "NCCL_DEBUG=INFO (NCCL_IB_HCA, the EFA plugin) and NCCL_SOCKET_IFNAME",
        )  # fmt: skip
    else:
        report.add("collective", "cluster", OK, value)


def check_forecast(
    report: Report,
    profile: Any,
    config: Any,
    facts: dict[str, dict[str, Any]],
    limit_gb: float | None,
) -> None:
    from raytrain_common.memory_forecast import fitting_knobs, forecast

    shape = report.shape
    try:
        step = profile.training_step(config)
        result = forecast(step)
    except Exception as error:
        report.add(
            "memory forecast", "worker", WARN, f"not forecast: {type(error).__name__}: {error}"[:300],
            "the model could not be built for the forecast; the run itself may still work",
        )  # fmt: skip
        return
    if limit_gb is not None:
        limit, against = int(limit_gb * GiB), f"the stated limit of {limit_gb:g} GiB"
    elif shape.use_gpu:
        gpus = [gpu["memory"] for f in facts.values() for gpu in f.get("gpus", [])]
        if not gpus:
            report.add(
                "memory forecast", "worker", WARN, result.describe() + "; no GPU seen to compare with",
                "pass --memory-limit-gb with the GPUs' memory",
            )  # fmt: skip
            return
        limit, against = min(gpus), f"the smallest GPU's {min(gpus) / GiB:.1f} GiB"
    else:
        per_node = [
            f["memory_available"] / max(1, min(shape.num_workers, os.cpu_count() or 1))
            for f in facts.values()
        ]
        limit, against = int(min(per_node)), "a worker's share of the node's available memory"
    value = f"{result.describe()}; {against}" + (
        f" ({step.description})" if step.description else ""
    )
    if result.total_bytes <= limit:
        report.add("memory forecast", "worker", OK, value)
        return
    knobs = fitting_knobs(step, result, limit, fsdp=profile.fsdp)
    report.add(
        "memory forecast",
        "worker",
        FAIL,
        value,
        "does not fit; any one of: " + "; ".join(knobs),
    )


def _bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in bundle.items()) + "}"


def _join(values: dict[str, str]) -> str:
    return ", ".join(f"{name} {value}" for name, value in values.items())


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raytrain-doctor",
        description=(
            "Check the Ray cluster at RAY_ADDRESS (or a new local one) for a run: versions and "
            "imports on every node, resources, a timed collective of the run's shape, the storage "
            "path from every node, /dev/shm, disks, memory, and a memory forecast of the model. "
            "Exit status 0 only when nothing FAILs."
        ),
        epilog=(
            "With --pipeline, the shape comes from that pipeline's train flags given after `--`, "
            "e.g. `raytrain-doctor --pipeline NAME -- --preset gpu --num-workers 8`; the "
            "options here override them."
        ),
    )
    parser.add_argument(
        "--pipeline", help="Take the run's shape, imports and model from this pipeline."
    )
    parser.add_argument("--num-workers", type=int, help="Training workers (default 2).")
    parser.add_argument("--cpus-per-worker", type=float, help="CPUs per worker (default 1).")
    parser.add_argument("--gpus-per-worker", type=float, help="GPUs per worker (default 0: CPU).")
    parser.add_argument(
        "--placement-strategy", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
    )
    parser.add_argument("--storage-path", help="The run's storage path (default ./runs).")
    parser.add_argument(
        "--storage-is-shared", action="store_true", default=None,
        help="A local-looking path is a shared mount of a kind not recognised (as train's flag).",
    )  # fmt: skip
    parser.add_argument(
        "--require-module", action="append", default=[],
        help="Also import this module on every node (repeatable).",
    )  # fmt: skip
    parser.add_argument("--collective-timeout-s", type=float, default=60.0,
                        help="Seconds the collective may take before it counts as hung (60).")  # fmt: skip
    parser.add_argument(
        "--collective-mb", type=int, help="All-reduce payload for the bandwidth (MiB)."
    )
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument("--memory-limit-gb", type=float,
                        help="Compare the forecast with this many GiB per worker (default: the GPU's).")  # fmt: skip
    parser.add_argument("--autoscaling", action="store_true",
                        help="The cluster adds nodes on demand: missing resources are a WARN.")  # fmt: skip
    parser.add_argument(
        "--json", metavar="FILE", help="Also write the table as JSON (- for stdout)."
    )
    parser.add_argument(
        "train_args", nargs=argparse.REMAINDER, help="-- then the pipeline's train flags."
    )
    return parser


def shape_from(args: argparse.Namespace, config: Any | None) -> Shape:
    shape = Shape()
    if config is not None:
        shape = Shape(
            num_workers=config.num_workers,
            cpus_per_worker=config.cpus_per_worker,
            gpus_per_worker=config.gpus_per_worker if config.use_gpu else 0.0,
            placement_strategy=config.placement_strategy,
            accelerator_type=config.accelerator_type,
            storage_path=config.storage_path,
            storage_is_shared=config.storage_is_shared,
        )
    for name in ("num_workers", "cpus_per_worker", "gpus_per_worker", "placement_strategy",
                 "storage_path", "storage_is_shared"):  # fmt: skip
        value = getattr(args, name)
        if value is not None:
            setattr(shape, name, value)
    if _is_local(shape.storage_path):
        shape.storage_path = os.path.abspath(shape.storage_path.removeprefix("file://"))
    return shape


def run_checks(args: argparse.Namespace) -> Report:
    import ray

    from raytrain_common.pipeline_profiles import load_profile
    from raytrain_common.ray_start import init_ray, quiet_ray_output

    profile = load_profile(args.pipeline) if args.pipeline else None
    train_args = [a for a in args.train_args if a != "--"]
    config = profile.train_config(train_args) if profile else None
    report = Report(shape_from(args, config))
    shape = report.shape
    distributions = [COMMON_DISTRIBUTION] + ([profile.distribution] if profile else [])
    modules = [*(profile.worker_imports if profile else ()), *args.require_module]

    init_ray(train_cpus=shape.num_workers * shape.cpus_per_worker)
    quiet_ray_output(verbose=False)
    nodes = alive_nodes()
    driver = probe_node(distributions, [], [])
    facts = probe_nodes(report, nodes, distributions, modules)
    check_versions(report, facts, driver)
    check_imports(report, facts, modules)
    check_resources(report, nodes, args.autoscaling)
    check_auth(report, facts, dashboard_address())
    check_system(report, facts)
    check_storage(report, nodes)
    if not any(row.check == "resources" and row.status == FAIL for row in report.rows):
        check_collective(report, args.collective_timeout_s, args.collective_mb, args.backend)
    if profile is not None:
        check_forecast(report, profile, config, facts, args.memory_limit_gb)
    ray.shutdown()
    return report


def print_table(report: Report, seconds: float, out: Any = sys.stdout) -> None:
    shape = report.shape
    out.write(
        f"raytrain-doctor: {shape.num_workers} worker(s) of {_bundle(shape.bundle())}, "
        f"storage {shape.storage_path}\n"
    )
    widths = [
        max(len(getattr(row, key)) for row in report.rows) for key in ("check", "node", "status")
    ]
    titles = ("CHECK", "NODE", "STATUS")
    widths = [max(width, len(title)) for width, title in zip(widths, titles, strict=True)]
    out.write("  ".join(t.ljust(w) for t, w in zip(titles, widths, strict=True)) + "  VALUE\n")
    for row in report.rows:
        cells = (row.check, row.node, row.status)
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
        out.write(f"{line}  {row.value}\n")
        if row.fix:
            out.write(" " * (widths[0] + 2) + "fix: " + row.fix + "\n")
    counts = report.counts()
    verdict = "FAIL" if report.failed else "OK"
    out.write(
        f"{verdict}: {counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL in {seconds:.0f} s\n"
    )
    out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    from raytrain_common.configs import ConfigError

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    args = build_parser().parse_args(argv)
    start = time.monotonic()
    try:
        report = run_checks(args)
    except ConfigError as error:
        print(f"raytrain-doctor: error: {error}", file=sys.stderr)
        return 2
    seconds = time.monotonic() - start
    print_table(report, seconds)
    if args.json:
        document = {
            "ok": not report.failed,
            "seconds": round(seconds, 1),
            "shape": asdict(report.shape),
            "rows": [asdict(row) for row in report.rows],
        }
        text = json.dumps(document, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            temporary = f"{args.json}.tmp-{os.getpid()}"
            with open(temporary, "w", encoding="utf-8") as stream:
                stream.write(text)
            os.replace(temporary, args.json)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
