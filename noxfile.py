"""The repository's sessions. `nox -l` lists them all:

- one per pipeline and hardware, and its benchmark, each registered by its pipeline's own
  `pipelines/*/sessions.py` (a pipeline you add brings its own);
- `quick` (no Ray cluster), `tests`, `tests_gpu`, `faults`, `memory_cap`, `manifests` and `lint`
  (ruff and mypy), over every package: `nox -s lint tests manifests faults`, the README's test
  command that CI runs, runs every test but the GPU ones (no tier is left out);
- `new_pipeline`: copy a pipeline under a new name, here or as a standalone project;
- `doctor`: check a Ray cluster for a run before the run (`raytrain-doctor`);
- `ui`: MLflow's UI on the local tracking store the runs write.

The pins, the shared environment and the helpers the sessions use are in tools/nox_stack.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "tools"))

from nox_stack import (  # noqa: E402  (found through the path set just above)
    MYPY,
    RUFF,
    import_packages,
    pipeline_folders,
    require_gpus,
    run_in_stack,
    stack_python,
)

nox.options.sessions = ["lint", "tests", "manifests"]
nox.options.error_on_external_run = False


def load_pipeline_sessions() -> None:
    """Import pipelines/*/sessions.py: each registers its pipeline's sessions with nox."""
    for folder in pipeline_folders():
        sessions = folder / "sessions.py"
        if not sessions.is_file():
            continue
        spec = importlib.util.spec_from_file_location(f"{folder.name}_sessions", sessions)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


load_pipeline_sessions()


# Two pytest processes (pytest-xdist), a test file's tests in one of them (module fixtures: one
# shared run, one cluster), each process with its own Ray cluster. On 2 cores one process left them
# ~22 % idle (Ray's starts and polls, the drivers' waits); two keep them ~95 % busy (the sessions'
# times: docs/benchmarks.md). Two, not one per core: each process's clusters hold a few GiB.
PARALLEL = ("--numprocesses", "2", "--dist", "loadfile")


def run_marked_tests(session: nox.Session, markers: str, *default_args: str) -> None:
    """pytest on the tests `markers` selects, in the shared environment; arguments after `--`
    replace `-q` and `default_args`."""
    python = stack_python(session)
    args = session.posargs or ["-q", *default_args]
    run_in_stack(session, python, "-m", "pytest", "-m", markers, *args)


# The CI sessions' pytest selections: together every test (tests/test_repo.py checks it), GPU
# tests skipped where there is no GPU.
TESTS_MARKERS = "not manifests and not faults and not memory_cap"
FAULTS_MARKERS = "faults or memory_cap"
MANIFESTS_MARKERS = "manifests"


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Every package's tests and the cross-cutting ones, on real Ray clusters: all but the
    manifests' and those that start their own multi-node clusters (`faults`)."""
    run_marked_tests(session, TESTS_MARKERS, *PARALLEL, "--durations=60")


@nox.session(venv_backend="none")
def quick(session: nox.Session) -> None:
    """The fast tier: every test that needs no Ray cluster, no fault injection, no memory cap and
    no GPU (~2 minutes after the shared environment exists); `tests` runs these and the Ray ones."""
    run_marked_tests(
        session,
        "not ray and not faults and not manifests and not gpu and not memory_cap",
        "--durations=5",
    )


@nox.session(venv_backend="none")
def faults(session: nox.Session) -> None:
    """The tests that start multi-node Ray clusters of their own, in pytest processes of their own
    (two at a time, as `tests`): faults injected into real runs (nodes preempted and lost,
    workers, drivers and ingest nodes killed, storage outages; docs/faults.md) and the
    memory-capped runs (`memory_cap`: root and cgroup v1, which CI's box has)."""
    run_marked_tests(session, FAULTS_MARKERS, *PARALLEL, "--durations=0")


@nox.session(venv_backend="none")
def memory_cap(session: nox.Session) -> None:
    """The memory-capped runs alone (`faults` runs them too): each pipeline trained on a node of a
    real 2-node cluster whose memory is capped (cgroup v1, as a pod's limit) below its measured
    baseline plus its training split. Needs root."""
    run_marked_tests(session, "memory_cap", "-s", "--durations=0")


@nox.session(venv_backend="none")
def tests_gpu(session: nox.Session) -> None:
    """The `gpu` tests: each pipeline's gpu preset for a few steps, the chunked loss on the GPU."""
    require_gpus(session, cpu_session="tests", manifest="<pipeline>.yaml")
    python = stack_python(session)
    run_in_stack(session, python, "-m", "pytest", "-m", "gpu", *(session.posargs or ["-q"]))


@nox.session(venv_backend="none")
def bench_ray_train_floor(session: nox.Session) -> None:
    """What a Ray Train run costs before its function's first line, with nothing to train: the
    imports, a local cluster's start, then empty 2-worker runs (tools/bench_ray_train_floor.py)."""
    python = stack_python(session)
    run_in_stack(session, python, "tools/bench_ray_train_floor.py", *session.posargs)


@nox.session(venv_backend="none")
def bench_data(session: nox.Session) -> None:
    """Memory and throughput as each pipeline's dataset grows: every pipeline with a
    benchmarks/<pipeline>/bench_data module prepares and trains its dataset at 1×, 4× and 16× a base size and prints the peak
    memory of `prepare` and of a training worker, items/s, and the ratios largest ÷ smallest.
    Arguments go to every pipeline's module, e.g. `nox -s bench_data -- --scales 1,4`."""
    python = stack_python(session)
    for package in import_packages():
        if (ROOT / "benchmarks" / package.name / "bench_data.py").is_file():
            module = f"benchmarks.{package.name}.bench_data"
            run_in_stack(session, python, "-m", module, *session.posargs)


@nox.session(venv_backend="none")
def manifests(session: nox.Session) -> None:
    """deploy/: every RayJob and kustomize output against KubeRay's CRD and Kubernetes' schemas,
    and the image the RayJobs name built here (podman): each pipeline run in it as a pod, and each
    RayJob's entrypoint (at the CPU smoke size) on a Ray cluster of its containers, submitted as
    KubeRay's submitter does."""
    python = stack_python(session)
    run_in_stack(
        session,
        python,
        "-m",
        "pytest",
        "-m",
        MANIFESTS_MARKERS,
        "tests/test_manifests.py",
        "tests/test_image.py",
        "tests/test_container_cluster.py",
        *(session.posargs or ["-q", *PARALLEL]),
    )


@nox.session(venv_backend="none")
def cluster(session: nox.Session) -> None:
    """A Ray cluster that stays up, so `train` attaches to it instead of starting one: the edit-run
    loop (docs/benchmarks.md: bench_first_step). `nox -s cluster` starts it in .nox/ray-cluster and
    prints the variables to export; `nox -s cluster -- stop` stops it, and only it."""
    python = stack_python(session)
    folder = str(Path(".nox") / "ray-cluster")
    verb = session.posargs[0] if session.posargs else "start"
    run_in_stack(session, python, "-m", "raytrain_common.local_cluster", verb, folder)


@nox.session(venv_backend="none")
def bench_first_step(session: nox.Session) -> None:
    """Each pipeline's first optimiser step, cold and attached to a running cluster, against Ray
    Train's floor in the same run (tools/bench_first_step.py); ~10 minutes on 2 cores."""
    python = stack_python(session)
    run_in_stack(session, python, "tools/bench_first_step.py", *session.posargs)


@nox.session(venv_backend="none")
def doctor(session: nox.Session) -> None:
    """`raytrain-doctor`: check the cluster at RAY_ADDRESS (or a new local one) for a run, in under
    a minute. Arguments go to it, e.g. `nox -s doctor -- --pipeline NAME --storage-path
    /mnt/runs -- --preset gpu --num-workers 8` (after the second `--`: the pipeline's train
    flags)."""
    python = stack_python(session)
    run_in_stack(session, python, "-m", "raytrain_common.doctor", *session.posargs)


@nox.session(venv_backend="none")
def ui(session: nox.Session) -> None:
    """MLflow's UI on the runs' local store (`./runs/mlflow.db`), at http://127.0.0.1:5000; Ctrl-C
    stops it. Extra arguments go to `mlflow ui` (e.g. `-- --port 5001`)."""
    python = stack_python(session)
    store = ROOT / "runs" / "mlflow.db"
    if not store.exists():
        session.log(f"{store} does not exist yet: it appears with the first run (`nox -s mnist`)")
    port = "5000"
    if "--port" in session.posargs:
        port = session.posargs[session.posargs.index("--port") + 1]
    session.log(f"MLflow UI at http://127.0.0.1:{port} (runs of {store})")
    run_in_stack(
        session,
        python,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        f"sqlite:///{store}",
        "--host",
        "127.0.0.1",
        *([] if "--port" in session.posargs else ["--port", port]),
        *session.posargs,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint rules and formatting) and mypy (types, over common, the pipelines and tools)."""
    session.install(RUFF, MYPY)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    packages = import_packages()
    search_path = os.pathsep.join(str(package.parent) for package in packages)
    benchmarks = ["benchmarks"] if (ROOT / "benchmarks").is_dir() else []  # a copy may lack them
    session.run("mypy", *map(str, packages), "tools", *benchmarks, env={"MYPYPATH": search_path})


# The image's locks: deploy/requirements/*.in resolved for the image's Python and platform (3.11 on
# x86_64 Linux, as rayproject/ray:2.60.0-py311-gpu; `-- --python-platform aarch64-manylinux_2_28`
# for Ray's -aarch64 images) into *.txt, every distribution with its sha256; the Dockerfile
# installs them with --require-hashes. Needs the package index; rerun after changing a pin.
UV = "uv==0.13.8"
LOCKS = {"image": [], "no-deps": ["--no-deps"], "corpora": ["--no-deps", "--no-binary", ":all:"]}


@nox.session
def lock(session: nox.Session) -> None:
    """deploy/requirements/*.txt from their .in files, with hashes (uv's resolver: it reads the
    wheels' metadata from the index without downloading torch's 900 MB)."""
    session.install(UV)
    folder = ROOT / "deploy" / "requirements"
    for name, options in LOCKS.items():
        session.run(
            "uv", "pip", "compile", str(folder / f"{name}.in"), "-o", str(folder / f"{name}.txt"),
            "--python-version", "3.11", "--generate-hashes", "--native-tls", "--quiet",
            "--python-platform", "x86_64-manylinux_2_28", "--custom-compile-command", "nox -s lock",
            *options, *session.posargs,
        )  # fmt: skip


@nox.session
def new_pipeline(session: nox.Session) -> None:
    """Copy a pipeline under a new name: `nox -s new_pipeline -- --from PIPELINE --name NEW_NAME`
    (in this repo, sessions and manifest included), or add `--out DIR` for a standalone project."""
    session.install(RUFF)  # the copy's imports re-sorted under its new name
    session.run("python", str(ROOT / "tools" / "new_pipeline.py"), *session.posargs)
