"""Fixtures every test folder shares: one real local Ray cluster per test session; `gpu` tests
skipped where there is no CUDA GPU."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every Ray cluster of this test session (local ones, the multi-node harness's, the manifests'
# head) runs with token authentication and this session's own token, never with whatever
# ~/.ray/auth_token holds; the tests that check refusals start their clients without it.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
os.environ.pop("RAY_AUTH_TOKEN_PATH", None)


OWN_CLUSTER_MARKERS = ("faults", "memory_cap")


def starts_own_cluster(item: pytest.Item) -> bool:
    return any(marker in item.keywords for marker in OWN_CLUSTER_MARKERS)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: `items` is what will run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests run where CUDA is and are skipped, with the reason, everywhere else. `faults`
    and `memory_cap` tests start their own multi-node clusters, which cannot share a process with
    the session's single-node one: selected beside other tests (a bare `pytest`), they are skipped
    with the command that runs them; `nox -s faults` runs both kinds in pytest processes of their
    own, so the README's test command skips none."""
    import torch

    own = [item for item in items if starts_own_cluster(item)]
    if own and len(own) < len(items):
        skip = pytest.mark.skip(reason="starts its own multi-node cluster: `nox -s faults`")
        for item in own:
            item.add_marker(skip)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Credentials for the S3 protocol servers on loopback (moto) that some tests start, set before any
# test starts a Ray cluster: every Ray process inherits them (pyarrow takes none in a URI). Never
# valid on AWS.
for _name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
    os.environ.setdefault(_name, "testing")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster started the way the pipelines start one (2 workers' CPUs + Ray
    Data's)."""
    import ray

    from raytrain_common.ray_start import init_ray

    os.environ.pop("RAY_ADDRESS", None)
    init_ray(train_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture
def ray_address(ray_cluster: None) -> str:
    """The address of this process's cluster, for a command run as a subprocess to join through
    RAY_ADDRESS (as on a cluster of the user's own) instead of starting a cluster of its own.

    A CLI error in this process (`main([...])` returning 2) ends the cluster it started, so the
    session's cluster may be gone: then one is started again, as `ray_cluster` started it."""
    import ray

    from raytrain_common.ray_start import init_ray

    if not ray.is_initialized():
        os.environ.pop("RAY_ADDRESS", None)
        init_ray(train_cpus=2)
    return ray.get_runtime_context().gcs_address


@pytest.fixture
def s3_prefix() -> Iterator[str]:
    """`s3://corpus/?endpoint_override=…`: the root of a bucket on a real S3 protocol server (moto)
    on loopback, in a process of its own (raytrain_testkit.s3), which every Ray process reaches
    through pyarrow's S3 (with the credentials the root conftest gives every process); paths go
    after `corpus/` (`join_uri`)."""
    pytest.importorskip("moto.server")
    from raytrain_testkit.s3 import s3_server

    with s3_server(buckets=["corpus"]) as server:
        yield server.uri("corpus")


@pytest.fixture
def small_volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Path]]:
    """`small_volume("2m")`: a real file system of that size (tmpfs) that fills up, as a storage
    volume does; `read_only=True`: mounted read-only, as a volume remounted after an error is.
    Unmounted after the test. Skips where mounting needs a root this user lacks (CI runs as
    root, so none is skipped there)."""
    mounted: list[Path] = []

    def mount(size: str, read_only: bool = False) -> Path:
        folder = tmp_path_factory.mktemp(f"volume-{size}")
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


_cpu_meter: Any = None  # this pytest process's CpuMeter, made at its first test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With $RAYTRAIN_TEST_COSTS set (`.ci/run` sets it), each test's wall and CPU-seconds (its
    setup and teardown included: a session fixture's cluster counts against the first test that
    asks for it) go to a file there; `.ci/run` prints the ten most expensive at its end
    (raytrain_testkit.costs says how the CPU is counted)."""
    global _cpu_meter
    folder = os.environ.get("RAYTRAIN_TEST_COSTS")
    if not folder:
        yield
        return
    from raytrain_testkit.costs import CpuMeter, record_cost

    if _cpu_meter is None:
        _cpu_meter = CpuMeter()
    started_cpu, started_wall = _cpu_meter.seconds(), time.monotonic()
    yield
    record_cost(Path(folder), item.nodeid, _cpu_meter, started_cpu, started_wall)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _cpu_meter is not None:
        _cpu_meter.close()


def box_speed() -> str:
    """Training images/s of a ResNet18 (32×32, batch 64, forward and backward) in this process on
    this machine's cores: printed beside each session's time, so a CI time from a slower box (the
    same kind of box differs ~2×) can be read as such. About 5 s."""
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    images, labels = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up: allocator and kernels
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < 4.0:
        step()
        steps += 1
    rate = steps * 64 / (time.perf_counter() - started)
    return f"{rate:.0f} images/s (ResNet18 32×32 training, {torch.get_num_threads()} threads)"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The box's speed under the session's results (see box_speed)."""
    if terminalreporter.config.option.collectonly:
        return
    terminalreporter.write_line(f"box speed: {box_speed()}")
