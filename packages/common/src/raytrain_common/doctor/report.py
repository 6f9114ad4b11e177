"""The doctor's table: a row per check and node (OK, WARN or FAIL, what was measured, the fix), the
run's shape it checks for, and the thresholds."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

OK, WARN, FAIL = "OK", "WARN", "FAIL"


GiB = 2**30


PROBE_TIMEOUT_S = 120.0


COMMON_DISTRIBUTION = "raytrain-common"


SHM_MIN_GPU_BYTES = 1 * GiB  # NCCL's shared-memory transport and DataLoader workers


TEMP_MIN_FREE_BYTES = 5 * GiB  # Ray spills objects and unpacks runtime envs under its temp folder


STORAGE_MIN_FREE_BYTES = 10 * GiB


COLLECTIVE_CAUSES = (
    "ports closed between the nodes (torch.distributed's TCP store and gloo/NCCL use random "
    "ports), the wrong network interface (set NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME to the one "
    "the nodes share, e.g. eth0), InfiniBand not set up (NCCL_DEBUG=INFO shows it; NCCL_IB_HCA, "
    "or NCCL_IB_DISABLE=1 without it), or a rank stuck on an overloaded node"
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


def short(node_id: str) -> str:
    return node_id[:8]


def bundle_text(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in bundle.items()) + "}"


def joined(values: dict[str, str]) -> str:
    return ", ".join(f"{name} {value}" for name, value in values.items())


def is_local_path(path: str) -> bool:
    return "://" not in path or path.startswith("file://")
