"""Prepared data built once per machine and shared by every test process.

The tests train on real prepared datasets (MNIST, VADER pre-tokenised, Shakespeare packed) that
take tens of CPU-seconds each to prepare. `prepared_once(name, key, build)` builds a dataset once
under a cache folder, keyed by everything its bytes depend on (the source's digest, the options,
the preparing packages' versions and sources), and hands every later caller, in any pytest
process or nox session on the machine, the same folder to read:

- **one builder**: an exclusive `fcntl.flock` on the entry's lock file, which the kernel releases
  when its holder dies, so a killed builder never leaves others waiting;
- **never half-written**: an entry is used only when its `complete.json`, written last, names the
  same key and every file it lists still has its size; anything else in the entry's place (a
  builder killed midway, a file truncated since) is removed and built again;
- **never stale**: a changed key is a different entry (its digest in the folder's name);
- **read-only**: the entry's files lose their write bits once built (a test that writes into
  shared data fails where it runs as a user; as root, the sizes checked at each use catch it).

The cache lives in `$RAYTRAIN_TEST_CACHE`, else `~/.cache/raytrain-tests`. A test that proves
`prepare` itself (forced, refused, edited trees) prepares its own folder and never comes here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

COMPLETE = "complete.json"


def cache_root() -> Path:
    return Path(os.environ.get("RAYTRAIN_TEST_CACHE") or Path.home() / ".cache" / "raytrain-tests")


def file_digest(path: str | Path) -> str:
    """A source file's identity for a key: its SHA-256 (a path alone would miss a new download)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def packages_key(*packages: str) -> dict[str, str]:
    """The part of a key the preparing code gives: each named, importable package's version
    (`__version__`) and the digest of its .py files, so that an edit to a `prepare` nobody gave a
    new version still makes a new entry (the versions alone would not)."""
    import importlib

    digest, versions = hashlib.sha256(), []
    for name in packages:
        module = importlib.import_module(name)
        versions.append(f"{name} {getattr(module, '__version__', '?')}")
        root = Path(module.__file__ or "").parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return {"packages": ", ".join(versions), "sources": digest.hexdigest()}


def entry_name(name: str, key: Mapping[str, str]) -> str:
    canonical = json.dumps(dict(key), sort_keys=True)
    return f"{name}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def files_of(folder: Path) -> dict[str, int]:
    return {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != COMPLETE
    }


def is_complete(entry: Path, key: Mapping[str, str]) -> bool:
    """The entry was finished for this key and has lost no file and no byte since."""
    try:
        record = json.loads((entry / COMPLETE).read_text())
    except (OSError, ValueError):
        return False
    return record.get("key") == dict(key) and record.get("files") == files_of(entry)


def make_read_only(paths: Iterable[Path]) -> None:
    for path in paths:
        if path.is_file():
            mode = path.stat().st_mode
            path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def remove(entry: Path) -> None:
    """Removes an unfinished or damaged entry (write bits back first: the files were made read-only,
    and a folder's entries need its write bit to go)."""
    for path in entry.rglob("*"):
        if path.is_dir():
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    shutil.rmtree(entry, ignore_errors=True)


def prepared_once(
    name: str, key: Mapping[str, str], build: Callable[[Path], None], root: Path | None = None
) -> Path:
    """The folder holding `build(folder)`'s output for `key`, built by the first caller on the
    machine and shared read-only by every later one. `build` writes into the empty folder it is
    given (it may be called again after a failure: nothing it left is ever used)."""
    root = root or cache_root()
    entry = root / entry_name(name, key)
    with exclusive(root / f"{entry.name}.lock"):
        if is_complete(entry, key):
            return entry
        if entry.exists():
            remove(entry)
        entry.mkdir(parents=True)
        build(entry)
        files = files_of(entry)
        make_read_only(entry / relative for relative in files)
        record = {"key": dict(key), "files": files}
        temporary = entry / f".{COMPLETE}.tmp"
        temporary.write_text(json.dumps(record, indent=1, sort_keys=True))
        temporary.rename(entry / COMPLETE)  # written last: its presence means the entry is whole
    return entry
