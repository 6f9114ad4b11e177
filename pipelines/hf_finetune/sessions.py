"""This pipeline's nox sessions. The repository's noxfile loads every pipelines/*/sessions.py, so a
copied pipeline brings its sessions with it (`nox -s new_pipeline` renames them)."""

from __future__ import annotations

from pathlib import Path

import nox

from nox_stack import require_gpus, run_benchmark, run_in_stack, run_location, stack_python

PACKAGE = "hf_finetune"
SESSION = "hf_finetune"  # also names `<SESSION>_gpu`
SWEEP_SESSION = "sweep_hf"
BENCH_SESSION = "bench_tokenize"
EXAMPLES = Path(__file__).parent / "examples" / "sentences.txt"


@nox.session(name=SESSION, venv_backend="none")
def cpu(session: nox.Session) -> None:
    """MiniLM-L6 fine-tuned on VADER sentiment, 2 CPU workers, offline: ≥ 0.80 test accuracy.

    Extra arguments go to `train`, e.g. `nox -s hf_finetune -- --epochs 1`.
    """
    python = stack_python(session)
    run_in_stack(session, python, "-m", PACKAGE, "prepare")
    # train ends by scoring its best checkpoint on the test split once (`evaluate` scores others)
    run_in_stack(session, python, "-m", PACKAGE, "train", "--preset", "cpu", *session.posargs)
    passed = run_location(session.posargs)
    run_in_stack(session, python, "-m", PACKAGE, "predict", *passed, str(EXAMPLES))


@nox.session(name=f"{SESSION}_gpu", venv_backend="none")
def gpu(session: nox.Session) -> None:
    """MiniLM-L6 on VADER on every visible GPU (one worker each), bf16."""
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


@nox.session(name=BENCH_SESSION, venv_backend="none")
def bench(session: nox.Session) -> None:
    """Pre-tokenisation rows/s: Ray Data ÷ `datasets.map(batched=True)`, same rows, same cores."""
    python = stack_python(session)
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench_tokenize", *session.posargs)


@nox.session(name="bench_hf_deepspeed", venv_backend="none")
def bench_deepspeed(session: nox.Session) -> None:
    """DeepSpeed ZeRO-2, ZeRO-3 with offload, and LoRA, each ÷ DDP through the pipeline: sentences/s,
    worker memory, checkpoint size, the same seed's loss curve (`python -m
    benchmarks.hf_finetune.bench_deepspeed`; ~5 minutes on 2 CPU cores)."""
    python = stack_python(session)
    run_in_stack(session, python, "-m", PACKAGE, "prepare")  # VADER, once (a rerun finds it)
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench_deepspeed", *session.posargs)


@nox.session(name=SWEEP_SESSION, venv_backend="none")
def sweep(session: nox.Session) -> None:
    """Ray Tune with ASHA over lr, batch size, warm-up and weight decay at a CPU size (~10 minutes
    here); prints the best config and the command that trains it in full. Rerun to resume it.

    On GPUs: `python -m hf_finetune sweep --preset gpu --max-concurrent-trials <GPUs>`.
    """
    python = stack_python(session)
    run_in_stack(session, python, "-m", PACKAGE, "prepare")
    run_in_stack(session, python, "-m", PACKAGE, "sweep", "--preset", "cpu", *session.posargs)
