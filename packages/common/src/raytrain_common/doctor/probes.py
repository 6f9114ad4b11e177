"""What the doctor runs on each node of the cluster (Ray tasks and actors pinned there): the node's
facts, a storage round trip, one rank of a timed collective."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from raytrain_common.configs import launcher_variables


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
    facts["launcher_variables"] = launcher_variables(os.environ)
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
    """One node's part of the storage check: write its file, or read and list the others', or
    delete."""
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
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=max(1.0, timeout_s)),
        )
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
            # Bus bandwidth as nccl-tests defines it: each rank sends and receives 2(n-1)/n of the
            # data.
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
