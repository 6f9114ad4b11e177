"""This pipeline's nox sessions. The repository's noxfile loads every pipelines/*/sessions.py, so a
copied pipeline brings its sessions with it (`nox -s new_pipeline` renames them)."""

from __future__ import annotations

import nox

from nox_stack import require_gpus, run_benchmark, run_in_stack, run_location, stack_python

PACKAGE = "mnist_resnet"
SESSION = "mnist"  # also names `<SESSION>_gpu`
SWEEP_SESSION = "sweep_mnist"
BENCH_SESSION = "bench_mnist"


@nox.session(name=SESSION, venv_backend="none")
def cpu(session: nox.Session) -> None:
    """ResNet18 on full MNIST, 2 CPU workers, offline data: ≥ 99 % test accuracy in ~6 minutes.

    Extra arguments go to `train`, e.g. `nox -s mnist -- --epochs 1`.
    """
    python = stack_python(session)
    run_in_stack(session, python, "-m", PACKAGE, "prepare")
    run_in_stack(session, python, "-m", PACKAGE, "train", "--preset", "cpu", *session.posargs)
    run_in_stack(session, python, "-m", PACKAGE, "predict", *run_location(session.posargs))


@nox.session(name=f"{SESSION}_gpu", venv_backend="none")
def gpu(session: nox.Session) -> None:
    """ResNet18 on MNIST on every visible GPU (one worker each), bf16."""
    gpus = require_gpus(session, cpu_session=SESSION, manifest=f"{PACKAGE}.yaml")
    python = stack_python(session)
    run_name = ["--run-name", f"{PACKAGE}_gpu"]
    run_in_stack(session, python, "-m", PACKAGE, "prepare")
    run_in_stack(
        session,
        python,
        "-m",
        PACKAGE,
        "train",
        "--preset",
        "gpu",
        "--num-workers",
        str(gpus),
        *run_name,
        *session.posargs,
    )
    run_in_stack(session, python, "-m", PACKAGE, "predict", *run_name)


@nox.session(name=BENCH_SESSION, venv_backend="none")
def bench(session: nox.Session) -> None:
    """Steady-state images/s of Ray Train ÷ the single-process baseline, same device: 2 CPU workers
    here, or the gpu preset with one worker per GPU (MFU, peak memory) where there are GPUs."""
    python = stack_python(session)
    run_in_stack(session, python, "-m", PACKAGE, "prepare")
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench", *session.posargs)


@nox.session(name="bench_validation", venv_backend="none")
def bench_validation(session: nox.Session) -> None:
    """Training steps/s with --validation async ÷ inline, runs alternated on the same rows
    (`python -m benchmarks.mnist_resnet.bench_validation`; ~6 minutes here)."""
    python = stack_python(session)
    run_in_stack(session, python, "-m", PACKAGE, "prepare")
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench_validation", *session.posargs)


@nox.session(name=f"{BENCH_SESSION}_order", venv_backend="none")
def bench_order(session: nox.Session) -> None:
    """An image tree's fresh order every epoch: the window mix against a random_shuffle of the
    whole list, on 1.28 M prepared rows, time to the first batch and per epoch
    (`python -m benchmarks.mnist_resnet.bench_epoch_order`)."""
    python = stack_python(session)
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench_epoch_order", *session.posargs)


@nox.session(name="bench_images", venv_backend="none")
def bench_images(session: nox.Session) -> None:
    """A synthetic JPEG tree at 1×, 4× and 16× 80,000 files, in place and as shards: prepare's
    time and driver memory, train's first step and memory, ratios to 1×
    (`python -m benchmarks.mnist_resnet.bench_images`; ~15 minutes and 6 GB of disk here)."""
    python = stack_python(session)
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench_images", *session.posargs)


@nox.session(name=SWEEP_SESSION, venv_backend="none")
def sweep(session: nox.Session) -> None:
    """Ray Tune with ASHA over lr, batch size, warm-up and weight decay at a CPU size (~8 minutes
    here); prints the best config and the command that trains it in full. Rerun to resume it.

    On GPUs: `python -m mnist_resnet sweep --preset gpu --max-concurrent-trials <GPUs>`.
    """
    python = stack_python(session)
    run_in_stack(session, python, "-m", PACKAGE, "prepare")
    run_in_stack(session, python, "-m", PACKAGE, "sweep", "--preset", "cpu", *session.posargs)
