"""The repo keeps its promises: CI runs the README's test command, sessions exist, pipelines stay
copyable."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from raytrain_testkit.pace import paced

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = sorted(p.parent for p in (ROOT / "pipelines").glob("[!.]*/pyproject.toml"))
PACKAGES = [ROOT / "packages" / "common", ROOT / "packages" / "testkit", *PIPELINES]


def readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    section = re.split(r"### \d+\. Run the tests", readme, maxsplit=1)[1]
    return re.search(r"```bash\n(.+?)\n```", section, re.S).group(1).strip()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    """The README's command, once, and CI's exit status is its (the cost table printed after it
    changes nothing)."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    nox_commands = [line for line in commands if line.startswith("nox ")]
    assert nox_commands == [f"{readme_test_command()} || status=$?"]
    assert commands[-1] == 'exit "$status"'
    after = commands[commands.index(nox_commands[0]) + 1 : -1]
    assert all(line.endswith("|| true") for line in after), after


def nox_sessions() -> list[str]:
    listing = subprocess.run(
        [sys.executable, "-m", "nox", "-l", "-f", str(ROOT / "noxfile.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return re.findall(r"^[*-] (\w+)", listing.stdout, re.M)


def test_noxfile_has_every_session_the_readme_names() -> None:
    """Read from the README, not a hand list: every `nox -s NAME` it shows exists."""
    readme = (ROOT / "README.md").read_text()
    named = re.findall(r"nox -s (\w+(?: \w+)*)", readme)
    wanted = {session for group in named for session in group.split()}
    for copy in re.findall(r"new_pipeline -- .*--name (\w+)", readme):  # the example copy's
        wanted -= {copy, f"{copy}_gpu", f"bench_{copy}"}
    assert {"mnist", "tests", "lint", "manifests", "faults", "new_pipeline"} <= wanted
    missing = wanted - set(nox_sessions())
    assert not missing, f"the README names sessions the noxfile lacks: {sorted(missing)}"


def pipeline_session(folder: Path) -> str:
    """The CPU session a pipeline's sessions.py declares (also `<it>_gpu`)."""
    return re.search(r'^SESSION = "(\w+)"', (folder / "sessions.py").read_text(), re.M).group(1)


def test_every_pipeline_brings_its_sessions() -> None:
    sessions = set(nox_sessions())
    for folder in PIPELINES:
        name = pipeline_session(folder)
        assert {name, f"{name}_gpu"} <= sessions, folder.name


@pytest.mark.parametrize(
    ("session", "cpu_session"),
    [
        *((f"{pipeline_session(p)}_gpu", pipeline_session(p)) for p in PIPELINES),
        ("tests_gpu", "tests"),
    ],
)
def test_gpu_session_fails_at_once_without_a_gpu(session: str, cpu_session: str) -> None:
    if (
        subprocess.run(
            ["sh", "-c", "command -v nvidia-smi"], capture_output=True, check=False
        ).returncode
        == 0
    ):
        pytest.skip("this machine has nvidia-smi")
    done = subprocess.run(
        [sys.executable, "-m", "nox", "-s", session, "-f", str(ROOT / "noxfile.py")],
        capture_output=True,
        text=True,
        timeout=paced(60),
        check=False,
        cwd=ROOT,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert f"{session} needs an NVIDIA GPU" in done.stderr + done.stdout
    assert f"nox -s {cpu_session}" in done.stderr + done.stdout


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_package_is_versioned_documented_and_tested(package: Path) -> None:
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    changelog = (package / "CHANGELOG.md").read_text()
    assert f"## {project['version']}" in changelog  # the current version has its entry
    assert (package / "README.md").exists()
    assert list((package / "tests").glob("test_*.py"))
    inits = list((package / "src").glob("*/__init__.py"))
    assert len(inits) == 1
    assert (
        f'__version__ = "{project["version"]}"' in inits[0].read_text()
    )  # summaries report the real version
    pins = [d for d in project["dependencies"] if d.startswith("raytrain-common")]
    common = tomllib.loads((ROOT / "packages/common/pyproject.toml").read_text())["project"]
    for pin in pins:  # the pipelines pin the common package of this tree
        assert pin.endswith(f"=={common['version']}"), pin


def test_common_never_names_a_pipeline() -> None:
    names = [p.name for p in PIPELINES]
    for source in (ROOT / "packages" / "common" / "src").rglob("*.py"):
        text = source.read_text()
        for name in names:
            assert name not in text, f"{source} names the pipeline {name}"


def module_imports(package: Path) -> dict[str, set[str]]:
    """Each module of an import package (its subpackages' too) → the modules it imports, in
    functions too."""
    imports: dict[str, set[str]] = {}
    for source in package.rglob("*.py"):
        parts = source.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names: set[str] = set()
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
        imports[name] = names
    return imports


def import_cycle(imports: dict[str, set[str]]) -> list[str] | None:
    """A cycle among the modules of `imports`, if there is one."""
    edges = {m: {d for d in names if d in imports and d != m} for m, names in imports.items()}
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> list[str] | None:
        if module in visiting:
            return [*visiting[visiting.index(module) :], module]
        if module in done:
            return None
        visiting.append(module)
        cycle = next((c for c in map(visit, sorted(edges[module])) if c), None)
        visiting.pop()
        done.add(module)
        return cycle

    return next((c for c in map(visit, sorted(edges)) if c), None)


def test_no_package_has_an_import_cycle() -> None:
    packages = [p for package in PACKAGES for p in package.glob("src/*/__init__.py")]
    assert len(packages) == len(PACKAGES)
    for init in packages:
        assert import_cycle(module_imports(init.parent)) is None, init.parent.name
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_common_wheel_ships_no_test_harness() -> None:
    """Users install raytrain-common; the harness (clusters on one box, memory caps, scaling
    measures, the vocabulary tests check) is raytrain-testkit's, and training code never imports
    it."""
    common = ROOT / "packages" / "common" / "src" / "raytrain_common"
    harness = {p.stem for p in (ROOT / "packages/testkit/src/raytrain_testkit").glob("*.py")}
    assert {"multinode", "memory_cap", "scaling", "vocabulary"} <= harness
    assert not harness & {p.stem for p in common.glob("*.py")} - {"__init__"}
    for source in [*common.rglob("*.py"), *ROOT.glob("pipelines/*/src/*/*.py")]:
        assert "raytrain_testkit" not in source.read_text(), source


def test_no_benchmark_ships_in_an_installed_package() -> None:
    """Benchmarks live in benchmarks/<pipeline>/ and run from their nox sessions; a pipeline's
    package holds what its copier trains with, and each session's module is there."""
    shipped = [*ROOT.glob("pipelines/*/src/**/*.py"), *ROOT.glob("packages/*/src/**/*.py")]
    assert not [p for p in shipped if p.stem.startswith("bench") or p.stem == "baseline"]
    modules = set()
    for sessions in ROOT.glob("pipelines/*/sessions.py"):
        package = re.search(r'^PACKAGE = "(\w+)"', sessions.read_text(), re.M)
        assert package, sessions
        for module in re.findall(r'f"benchmarks\.\{PACKAGE\}\.(\w+)"', sessions.read_text()):
            modules.add(ROOT / "benchmarks" / package.group(1) / f"{module}.py")
    assert modules and all(module.is_file() for module in modules), modules


@pytest.mark.parametrize("package", ["common", "testkit"])
def test_a_shared_packages_readme_lists_every_module(package: str) -> None:
    folder = ROOT / "packages" / package
    listed = set(re.findall(r"^\| `(\w+)` \|", (folder / "README.md").read_text(), re.M))
    modules = {p.stem for p in folder.glob("src/*/*.py")} - {"__init__", "__main__"}
    modules |= {p.parent.name for p in folder.glob("src/*/*/__init__.py")}  # subpackages
    assert modules == listed, f"listed but gone: {listed - modules}; unlisted: {modules - listed}"


def test_the_files_a_standalone_copy_takes_never_name_a_pipeline() -> None:
    """`new_pipeline --out` copies these as they are into a project holding one pipeline: a name
    of another pipeline there is a test or session that breaks in the copy (it happened once)."""
    names = [p.name for p in PIPELINES]
    for relative in ("noxfile.py", "conftest.py", "tests/test_manifests.py", "deploy/Dockerfile"):
        text = (ROOT / relative).read_text()
        for name in names:
            assert name not in text, f"{relative} names the pipeline {name}"


def test_checkpoints_are_never_unpickled_freely() -> None:
    call = "torch" + ".load("  # spelled apart so this file does not match itself
    for source in ROOT.glob("[!.]*/**/*.py"):
        for line in source.read_text().splitlines():
            if call in line:
                assert "weights_only=True" in line, f"{source}: {line.strip()}"


# ---------------------------------------------------------------------------------------------
# Copying a pipeline (`nox -s new_pipeline`): the drift tests
# ---------------------------------------------------------------------------------------------


def load_copy_tool(repo: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "new_pipeline", repo / "tools" / "new_pipeline.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def copy_pipeline(repo: Path, origin: str) -> str:
    """`origin` copied as `copy_of_<origin>` by the tool with its benchmarks, once per scratch
    repository."""
    name = f"copy_of_{origin}"
    if not (repo / "pipelines" / name).exists():
        done = subprocess.run(
            [
                sys.executable,
                str(repo / "tools" / "new_pipeline.py"),
                "--from",
                origin,
                "--name",
                name,
                "--with-benchmarks",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
    return name


@pytest.fixture(scope="module")
def scratch_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This repository's files as git sees them (tracked and new, not ignored), copied: the copies
    are made there, never here."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    scratch = tmp_path_factory.mktemp("repo")
    for relative in filter(None, listed):
        source = ROOT / relative
        if source.is_file():
            (scratch / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, scratch / relative)
    return scratch


ALLOWED_CHANGES = re.compile(r'^(version|__version__|SESSION|BENCH_SESSION|SWEEP_SESSION) = "')


@pytest.mark.parametrize("origin", [p.name for p in PIPELINES])
def test_a_copied_pipeline_differs_from_its_origin_only_in_the_renamed_names(
    origin: str, scratch_repo: Path
) -> None:
    """In the spirit of accelerate's ExampleDifferenceTests: map the copy's names back to the
    origin's and every file is the origin's, line for line, but for the version and session
    names."""
    name = copy_pipeline(scratch_repo, origin)
    tool = load_copy_tool(scratch_repo)
    source, copy = scratch_repo / "pipelines" / origin, scratch_repo / "pipelines" / name
    old, new = tool.PipelineNames.of(source), tool.PipelineNames.of(copy)
    assert (new.package, new.distribution, new.version) == (name, name.replace("_", "-"), "0.1.0")
    assert (new.session, new.bench_session, new.sweep_session, new.data_folder) == (
        name,
        f"bench_{name}",
        f"sweep_{name}",
        f"data/{name}",
    )

    originals = sorted(
        p.relative_to(source)
        for p in source.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.parts[-2].endswith(".egg-info")
    )
    copied = sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_file())
    renamed = [Path(*(name if part == origin else part for part in p.parts)) for p in originals]
    assert copied == sorted(renamed), "the copy has exactly the origin's files"
    for relative, copied_relative in zip(originals, renamed, strict=True):
        if relative.name == "CHANGELOG.md":
            continue  # a fresh one, checked below
        try:
            before = (source / relative).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            assert (source / relative).read_bytes() == (copy / copied_relative).read_bytes()
            continue
        back = tool.rename((copy / copied_relative).read_text(encoding="utf-8"), new, old)
        changed = [
            (a, b)
            for a, b in itertools.zip_longest(before.splitlines(), back.splitlines())
            if a != b
        ]
        assert all(a and b and ALLOWED_CHANGES.match(a) for a, b in changed), (relative, changed)
    benchmarks = scratch_repo / "benchmarks"
    bench_files = sorted(p.name for p in (benchmarks / origin).glob("*.py"))
    assert bench_files == sorted(p.name for p in (benchmarks / name).glob("*.py"))
    for bench in bench_files:
        text = (benchmarks / name / bench).read_text()
        assert tool.rename(text, new, old) == (benchmarks / origin / bench).read_text(), bench
    changelog = (copy / "CHANGELOG.md").read_text()
    assert "## 0.1.0" in changelog and f"Copied from `{origin}` {old.version}" in changelog

    manifest = (scratch_repo / "deploy" / "rayjob" / f"{name}.yaml").read_text()
    origin_manifest = (scratch_repo / "deploy" / "rayjob" / f"{origin}.yaml").read_text()
    assert tool.rename(manifest, new, old) == origin_manifest
    assert (
        f"  - {name}.yaml"
        in (scratch_repo / "deploy" / "rayjob" / "kustomization.yaml").read_text()
    )


# The cross-cutting suites run again in the scratch repository with the copies in place: all but
# the tests that copy pipelines (they would copy the copies) and those that need a Ray cluster or
# the manifests' Ray head (run by `nox -s tests` and `manifests` once a copy is installed).
# tests/test_bad_input.py is not among them: it calls the three origin CLIs by name, imported from
# the installed packages, so beside the copies it would run the same code `tests` runs (~50 s).
CROSS_CUTTING = [
    "tests/test_vocabulary.py",
    "tests/test_repo.py",
    "tests/test_known_failures.py",
    "tests/test_manifests.py",
]
NOT_IN_SCRATCH = (
    "not copied and not entrypoint_succeeds and not submission_without and not doctor_manifest "
    "and not every_test_but_the_gpu and not docs_faults_md"  # a collection of the whole repo: ~30 s
)


def test_copied_pipelines_cli_fast_tests_and_the_cross_cutting_suites_work(
    scratch_repo: Path,
) -> None:
    """Every copy runs under its new names: its CLI answers, and its tests that need no Ray cluster
    pass; and the cross-cutting suites (vocabulary, repo, known failures, manifests)
    pass with the three copies in place beside their origins, so no table keyed by the pipelines'
    names breaks on a new one (the Ray ones run in `nox -s tests` once a copy is installed, as the
    README says). The copies' tests and the suites run in one pytest process: one import of torch,
    Ray and transformers, not four (188 -> 131 CPU-seconds on a 2-core box)."""
    copies = [scratch_repo / "pipelines" / copy_pipeline(scratch_repo, p.name) for p in PIPELINES]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(copy / "src") for copy in copies)}
    helps = {
        copy.name: subprocess.Popen(
            [sys.executable, "-m", copy.name, "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for copy in copies
    }  # side by side: each is an import of torch and the pipeline, on one core
    tests = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-v",  # names each test, with its parameters: the copies' names show they were reached
            "-m",
            "not ray and not faults and not memory_cap and not gpu",
            "-k",
            NOT_IN_SCRATCH,
            *(str(copy.relative_to(scratch_repo) / "tests") for copy in copies),
            *CROSS_CUTTING,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=scratch_repo,
    )
    for name, process in helps.items():
        out, err = process.communicate(timeout=paced(300))
        assert process.returncode == 0, err
        assert out.startswith(f"usage: {name.replace('_', '-')}")
    out, _ = tests.communicate(timeout=paced(900))
    assert tests.returncode == 0, out[-3000:]
    passed = [line for line in out.splitlines() if " PASSED" in line]
    for copy in copies:
        # The copy's own tests ran, and its name reached the cross-cutting suites' parametrised
        # tests and passed there.
        assert any(line.startswith(f"pipelines/{copy.name}/tests/") for line in passed), copy.name
        assert any(line.startswith("tests/") and f"[{copy.name}]" in line for line in passed)


def ci_sessions_markers() -> dict[str, str]:
    """The pytest selections of the sessions the README's test command runs (noxfile.py)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    constants = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id.endswith("_MARKERS")
        and isinstance(node.value, ast.Constant)
    }
    sessions = readme_test_command().removeprefix("nox -s ").split()
    return {
        s: constants[f"{s.upper()}_MARKERS"]
        for s in sessions
        if f"{s.upper()}_MARKERS" in constants
    }


@pytest.fixture(scope="module")
def collected(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """Every test of the repository as pytest collects it: node id and markers."""
    target = tmp_path_factory.mktemp("collected") / "items.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "raytrain_testkit.collected",
        ],
        cwd=ROOT,
        env={**os.environ, "RAYTRAIN_COLLECTED": str(target)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(target.read_text())


def selected_by_ci(item: dict[str, object], markers: dict[str, str]) -> list[str]:
    """The CI sessions whose `-m` selection takes the test (manifests: only in the files its
    session names in noxfile.py)."""
    from _pytest.mark.expression import Expression

    names = set(item["markers"])  # type: ignore[arg-type]
    manifests_files = re.findall(r'"(tests/test_\w+\.py)"', (ROOT / "noxfile.py").read_text())
    sessions = []
    for session, expression in markers.items():
        if session == "manifests" and str(item["nodeid"]).split("::")[0] not in manifests_files:
            continue
        if Expression.compile(expression).evaluate(lambda name, names=names: name in names):
            sessions.append(session)
    return sessions


def test_the_ci_command_runs_every_test_but_the_gpu_ones(
    collected: list[dict[str, object]],
) -> None:
    """No tier outside CI: every collected test is selected by exactly one session of the README's
    test command (`nox -s lint tests manifests faults`), the GPU ones aside (they run, and skip,
    where there is no GPU)."""
    markers = ci_sessions_markers()
    assert set(markers) == {"tests", "manifests", "faults"}, markers
    assert len(collected) > 300
    outside = [item["nodeid"] for item in collected if not selected_by_ci(item, markers)]
    assert not outside, f"tests no CI session runs: {outside}"
    twice = [item["nodeid"] for item in collected if len(selected_by_ci(item, markers)) > 1]
    assert not twice, f"tests two CI sessions run: {twice}"


def test_every_fault_docs_faults_md_promises_names_a_test_ci_runs(
    collected: list[dict[str, object]],
) -> None:
    """docs/faults.md, row by row: each row of its table names at least one test
    (`file.py::test_name`), and each named test exists and is run by the CI command, not skipped
    there for a lack of GPU."""
    markers = ci_sessions_markers()
    by_name: dict[tuple[str, str], list[dict[str, object]]] = {}
    for item in collected:
        path, _, name = str(item["nodeid"]).partition("::")
        by_name.setdefault((Path(path).name, name.split("[")[0]), []).append(item)
    text = (ROOT / "docs" / "faults.md").read_text()
    table = text.split("| --- |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) >= 10
    for row in rows:
        named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", row)
        assert named, f"a row of docs/faults.md names no test: {row[:120]}"
        for file, test in named:
            items = by_name.get((file, test))
            assert items, f"docs/faults.md names {file}::{test}, which does not exist"
            for item in items:
                assert "gpu" not in item["markers"], f"{file}::{test} needs a GPU: CI skips it"
                assert selected_by_ci(item, markers), f"{file}::{test} is not run by CI"


NOT_A_DEADLINE = "# not a deadline"


def bare_deadlines(path: Path) -> list[str]:
    """Each place in `path` where a wait is a bare number of seconds: a `timeout=`/`timeout_s=`
    argument or default, `wait_for`'s limit, or `monotonic() + N`, given as a literal."""

    def literal(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, int | float)

    def called(node: ast.AST, name: str) -> bool:
        function = node.func if isinstance(node, ast.Call) else None
        return isinstance(function, ast.Name | ast.Attribute) and (
            getattr(function, "id", None) == name or getattr(function, "attr", None) == name
        )

    lines = path.read_text().splitlines()
    found: list[int] = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.Call):
            if any(k.arg in ("timeout", "timeout_s") and literal(k.value) for k in node.keywords):
                found.append(node.lineno)
            if called(node, "wait_for") and len(node.args) > 1 and literal(node.args[1]):
                found.append(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            if any(called(side, "monotonic") for side in (node.left, node.right)) and any(
                literal(side) for side in (node.left, node.right)
            ):
                found.append(node.lineno)
        elif isinstance(node, ast.FunctionDef):
            arguments = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults))
            defaults += [*node.args.defaults, *node.args.kw_defaults]
            for argument, default in zip(arguments, defaults, strict=True):
                if argument.arg in ("timeout", "timeout_s") and literal(default):
                    found.append(node.lineno)
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: "
        f"{lines[number - 1].strip()}"
        for number in sorted(set(found))
        if NOT_A_DEADLINE not in lines[number - 1]
    ]


def test_every_wait_in_a_test_follows_the_box_pace() -> None:
    """Issue 65: a fixed deadline tuned on an idle box fails on CI's slow or busy one. Every wait
    in the tests and their harness is `paced(seconds on the reference box)`
    (raytrain_testkit.pace) or derived from the run's own measured pace; a literal that is not a
    deadline says so on its line (`# not a deadline`)."""
    folders = [ROOT / "tests", ROOT / "packages" / "testkit" / "src"]
    folders += [package / "tests" for package in PACKAGES]
    files = [ROOT / "conftest.py", *(path for f in folders for path in sorted(f.rglob("*.py")))]
    offenders = [line for path in files for line in bare_deadlines(path)]
    assert not offenders, "bare deadlines (write paced(N)):\n" + "\n".join(offenders)


def test_the_deadline_check_sees_each_form(tmp_path: Path) -> None:
    example = tmp_path / "waits.py"
    example.write_text(
        "import subprocess, time\n"
        "subprocess.run(['true'], timeout=30)\n"
        "wait_for(lambda: ready(), 120, 'ready')\n"
        "deadline = time.monotonic() + 60\n"
        "def wait_ready(timeout_s=180): ...\n"
        "subprocess.run(['true'], timeout=paced(30))\n"
        "settings(timeout_s=60)  # not a deadline: a setting\n"
    )
    found = [line.split(":")[1] for line in bare_deadlines(example)]
    assert found == ["2", "3", "4", "5"]
