"""Checkpoint folders that are whole or refused, and loading that never runs pickled code.

Each pipeline calls `ray.train.report` itself, in its own checkpointer (every rank, since the
report is a barrier; rank 0, or every rank under FSDP, with a checkpoint): this module gives it
the folder's contents (`save_state`, `write_manifest`, `scratch_folder`), the upload that rides
out a storage outage, and the way back (`resume_checkpoint`).

Every checkpoint carries manifests (`manifest-rank<N>.json`: each file's size and SHA-256), written
after the files they describe, one per rank that wrote files. A checkpoint cut off mid-upload, or a
file truncated later, fails `verify_checkpoint` and is never loaded: a resume falls back to the
newest complete checkpoint in the run folder, and `load_state` refuses it with one line naming the
file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import ray.train
import torch
from torch import nn

from raytrain_common.storage import StorageError, StoragePath, lasting_storage_problem

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
MANIFEST_PREFIX = "manifest-rank"
WORLD_FILE = "manifest-world.json"  # how many rank manifests a complete checkpoint has
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class TornCheckpointError(RuntimeError):
    """A checkpoint whose files do not match its manifests (cut off mid-write, or truncated)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: str | os.PathLike[str], *, rank: int = 0, world_size: int = 1) -> Path:
    """Describe the files `rank` wrote into `folder` (all but manifests); call it after writing
    them.

    Rank 0 also records how many ranks write manifests, so a checkpoint missing one rank's files
    (and manifest) is seen as torn too.
    """
    root = Path(folder)
    files = {
        str(path.relative_to(root)): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.name.startswith("manifest-")
    }
    if rank == 0:
        _write_json_atomically(root / WORLD_FILE, {"ranks": world_size})
    return _write_json_atomically(root / f"{MANIFEST_PREFIX}{rank}.json", {"files": files})


def _write_json_atomically(target: Path, content: Any) -> Path:
    temporary = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        temporary.write_text(json.dumps(content, indent=1))
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target


def parse_manifest(checkpoint: str, name: str, data: bytes) -> dict[str, Any]:
    """A manifest's content; TornCheckpointError if it is cut off or not one (a full disk during
    the copy leaves a 0-byte or half-written file), so the checkpoint is skipped like any torn one
    instead of a JSONDecodeError stopping every resume."""
    try:
        content = json.loads(data.decode("utf-8"))
        if name == WORLD_FILE:
            valid = isinstance(content["ranks"], int) and content["ranks"] >= 1
        else:
            valid = all(
                isinstance(entry["size"], int) and isinstance(entry["sha256"], str)
                for entry in content["files"].values()
            )
    # JSONDecodeError and UnicodeDecodeError are ValueErrors; the others: JSON of another shape.
    except (ValueError, LookupError, TypeError, AttributeError) as error:
        raise TornCheckpointError(
            f"checkpoint {checkpoint!r}: {name} is cut off or damaged ({len(data)} bytes, "
            f"{type(error).__name__}): the checkpoint was not written whole"
        ) from error
    if not valid:
        raise TornCheckpointError(f"checkpoint {checkpoint!r}: {name} is not a manifest")
    return content


def verify_checkpoint(folder: str | os.PathLike[str], *, hashes: bool = True) -> None:
    """Raise TornCheckpointError, naming the checkpoint and the file, unless every rank's manifest
    is there and every file it lists has its size (and, with `hashes`, its SHA-256)."""
    root = Path(folder)
    world_file = root / WORLD_FILE
    if not world_file.is_file():
        raise TornCheckpointError(
            f"checkpoint {str(root)!r} has no {WORLD_FILE}: it was cut off before it was complete "
            "(or written by a version without manifests)"
        )
    ranks = parse_manifest(str(root), WORLD_FILE, world_file.read_bytes())["ranks"]
    for rank in range(ranks):
        manifest = root / f"{MANIFEST_PREFIX}{rank}.json"
        if not manifest.is_file():
            raise TornCheckpointError(
                f"checkpoint {str(root)!r} lacks {manifest.name}: "
                f"rank {rank}'s files are incomplete"
            )
        for name, expected in parse_manifest(str(root), manifest.name, manifest.read_bytes())[
            "files"
        ].items():
            path = root / name
            if not path.is_file():
                raise TornCheckpointError(f"checkpoint {str(root)!r} lacks {name}")
            size = path.stat().st_size
            if size != expected["size"]:
                raise TornCheckpointError(
                    f"checkpoint {str(root)!r}: {name} has {size} bytes, its manifest says "
                    f"{expected['size']} (truncated?)"
                )
            if hashes and _sha256(path) != expected["sha256"]:
                raise TornCheckpointError(
                    f"checkpoint {str(root)!r}: {name} does not match its SHA-256 (corrupted)"
                )


def resume_checkpoint(
    registered: ray.train.Checkpoint | None, run_dir: StoragePath, inside: str = ""
) -> ray.train.Checkpoint | None:
    """Where a restart or rerun resumes: the newest complete checkpoint in the run folder, or None.
    `registered` is Ray's latest (`ray.train.get_checkpoint()`, which the caller makes in plain
    view); `newest_complete_checkpoint` is the same search anywhere outside a training worker.

    Not only Ray's registered latest: a driver killed between a checkpoint's upload and its
    registration by the controller leaves a complete, newer checkpoint that Ray does not list, and
    resuming from it saves that work; a torn one is passed over.
    """
    checkpoint = newest_complete_checkpoint(run_dir, inside)
    if checkpoint is not None and (
        registered is None or registered.path.rstrip("/") != checkpoint.path.rstrip("/")
    ):
        log.warning(
            "resuming from %s, the newest complete checkpoint (Ray's latest registered: %s)",
            checkpoint.path,
            registered.path if registered else None,
        )
    return checkpoint


def newest_complete_checkpoint(
    run_dir: StoragePath, inside: str = ""
) -> ray.train.Checkpoint | None:
    """The newest checkpoint folder of the run whose files match its manifests, or None.

    Torn checkpoints (a file cut off, a manifest missing) are skipped, each named in a warning.
    Folder names sort by time (checkpoint_YYYY-MM-DD_HH-MM-SS.ffffff). `inside`: the subfolder
    holding the manifests, when the files sit one level down (the Hugging Face callback's
    `checkpoint/`).
    """
    selector = pafs.FileSelector(run_dir.path, allow_not_found=True)
    try:
        listed = run_dir.filesystem.get_file_info(selector)
    except OSError as error:
        raise StorageError(
            f"cannot list the run folder {run_dir.uri} to resume from it ({error}): check the "
            "storage's endpoint, credentials and network, then rerun the same command"
        ) from error
    candidates = sorted(
        (
            info.path
            for info in listed
            if info.type == pafs.FileType.Directory and info.base_name.startswith("checkpoint_")
        ),
        reverse=True,
    )
    for path in candidates:
        candidate = ray.train.Checkpoint(path, filesystem=run_dir.filesystem)
        if is_complete(candidate, inside):
            return candidate
    if candidates:
        log.warning("no complete checkpoint in %s: the run starts from the beginning", run_dir)
    return None


def best_complete_checkpoint(
    result: ray.train.Result, metric: str, mode: str = "max", inside: str = ""
) -> ray.train.Checkpoint | None:
    """The best of the run's registered checkpoints by `metric` whose files are complete (a torn
    one stays in Ray's registry until its keep policy drops it, but is never the answer)."""
    scored = [
        (checkpoint, metrics[metric])
        for checkpoint, metrics in result.best_checkpoints
        if isinstance(metrics.get(metric), (int, float)) and metrics[metric] == metrics[metric]
    ]
    scored.sort(key=lambda pair: pair[1], reverse=mode == "max")
    return next((c for c, _ in scored if is_complete(c, inside)), None)


def is_complete(checkpoint: ray.train.Checkpoint, inside: str = "") -> bool:
    """Whether the checkpoint's files match its manifests; a warning names a torn one."""
    try:
        with checkpoint.as_directory() as folder:
            verify_checkpoint(Path(folder) / inside)
    except TornCheckpointError as error:
        log.warning("skipping a torn checkpoint: %s", error)
        return False
    return True


def strip_prefixes(
    state_dict: Mapping[str, Any], prefixes: tuple[str, ...] = WRAPPER_PREFIXES
) -> dict[str, Any]:
    """Remove the key prefixes DDP (`module.`) and torch.compile (`_orig_mod.`) add, however
    nested."""
    stripped = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in prefixes:
                if key.startswith(prefix):
                    key = key[len(prefix) :]
                    changed = True
        stripped[key] = value
    return stripped


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP / torch.compile wrappers, whose state dict has clean keys."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def save_state(folder: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
    """torch.save `state` into `folder/state.pt` atomically (temporary file, then rename)."""
    target = Path(folder) / STATE_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{STATE_FILE}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        torch.save(dict(state), temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target


def load_state(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Load `folder/state.pt` on the CPU with `weights_only=True`, so a checkpoint cannot run code,
    after checking it against its manifest (TornCheckpointError if it is incomplete)."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {STATE_FILE} in checkpoint folder {str(folder)!r}")
    verify_checkpoint(folder)
    return torch.load(path, map_location="cpu", weights_only=True)


def load_remote_state(checkpoint: StoragePath) -> dict[str, Any]:
    """`state.pt` of a checkpoint on any storage (local, S3, GCS), checked against its manifest,
    loaded with `weights_only=True`; TornCheckpointError names a checkpoint that is incomplete."""
    manifest = checkpoint.join(f"{MANIFEST_PREFIX}0.json")
    if not manifest.exists():
        raise TornCheckpointError(
            f"checkpoint {checkpoint.uri} has no {manifest.uri.rsplit('/', 1)[-1]}: it was cut off "
            "before it was complete (or written by a version without manifests)"
        )
    name = manifest.uri.rsplit("/", 1)[-1]
    expected = parse_manifest(checkpoint.uri, name, manifest.read_bytes())["files"].get(STATE_FILE)
    data = checkpoint.join(STATE_FILE).read_bytes()
    if expected is None or len(data) != expected["size"]:
        raise TornCheckpointError(
            f"checkpoint {checkpoint.uri}: {STATE_FILE} has {len(data)} bytes, its manifest says "
            f"{expected and expected['size']} (truncated?)"
        )
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise TornCheckpointError(
            f"checkpoint {checkpoint.uri}: {STATE_FILE} does not match its SHA-256 (corrupted)"
        )
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def load_model_weights(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Load weights saved from a wrapped or plain model into a plain (or wrapped) one, strictly."""
    unwrap(model).load_state_dict(strip_prefixes(state_dict), strict=True)


UploadFn = Callable[[ray.train.Checkpoint, str], ray.train.Checkpoint]
MAX_BACKOFF_S = 30.0


def upload_with_retries(storage_uri: str, patience_s: float) -> UploadFn:
    """A `checkpoint_upload_fn` for `ray.train.report` that rides out a storage outage.

    Ray's own upload gives up at the first error (an S3 endpoint down, a bucket unreachable),
    which fails the worker group; and the restarted group cannot read the storage either, so the
    run is lost after its `max_failures`. This retries the whole copy with exponential backoff
    (1 s, 2 s, … 30 s) for up to `patience_s`, then raises a StorageError naming the storage. A
    copy cut off by the outage is copied again whole; until its manifest and files all arrive it
    is torn, so a resume never takes it and the previous checkpoint stays the one to load.
    """

    def upload(checkpoint: ray.train.Checkpoint, name: str) -> ray.train.Checkpoint:
        storage = ray.train.get_context().get_storage()
        started, delay, attempt = time.monotonic(), 1.0, 1
        while True:
            try:
                return storage.persist_current_checkpoint(checkpoint, name)
            except OSError as error:  # pyarrow's network and filesystem errors
                problem = lasting_storage_problem(error)
                if problem is not None:  # a full or read-only disk: retrying cannot help
                    raise StorageError(
                        f"checkpoint {name} could not be written to {storage_uri}: the storage "
                        f"{problem} ({str(error).splitlines()[0][:200]}). The previous checkpoint "
                        "is intact: free space or give a writable --storage-path, then rerun the "
                        "same command to resume from it"
                    ) from error
                waited = time.monotonic() - started
                if waited + delay > patience_s:
                    raise StorageError(
                        f"checkpoint {name} could not be written to {storage_uri} for "
                        f"{waited:.0f} s ({attempt} attempts; last error: {error}). The previous "
                        "checkpoint is intact: check the storage's endpoint, credentials and "
                        "network, then rerun the same command to resume from it (or raise "
                        "--storage-patience-s to wait longer)"
                    ) from error
                log.warning(
                    "storage %s unavailable (%s): retrying checkpoint %s in %.0f s",
                    storage_uri,
                    str(error).splitlines()[0][:200],
                    name,
                    delay,
                )
                time.sleep(delay)
                delay, attempt = min(2 * delay, MAX_BACKOFF_S), attempt + 1

    return upload


def raise_storage_error_of(error: Exception, storage_uri: str) -> None:
    """Re-raise a storage failure found inside Ray Train's failure as a StorageError, so the CLI
    prints its one line (the cause and the fix) instead of a traceback; return if there is none.

    Two places fail on storage: a worker's upload (our StorageError, after its retries), and the
    Ray Train controller, which records each checkpoint in the run folder right after its upload
    and does not retry (an outage at that instant ends the run; the checkpoints stay intact).
    """
    for failure in getattr(error, "worker_failures", {}).values():
        cause: BaseException | None = failure
        while cause is not None:
            if isinstance(cause, StorageError):
                raise StorageError(str(cause.args[0]) if cause.args else str(cause)) from error
            cause = cause.__cause__
    controller_failure = getattr(error, "controller_failure", None)
    if isinstance(controller_failure, OSError):
        first_line = str(controller_failure).strip().splitlines()[0]
        problem = lasting_storage_problem(controller_failure)
        if problem is not None:
            raise StorageError(
                f"Ray Train's controller could not write its record of the run to {storage_uri}: "
                f"the storage {problem} ({first_line}). The checkpoints already written are "
                "intact: free space or give a writable --storage-path, then rerun the same command"
            ) from error
        raise StorageError(
            f"Ray Train's controller could not write its record of the run to {storage_uri} "
            f"({first_line}). The checkpoints already written are intact: check the storage's "
            "endpoint, credentials and network, then rerun the same command to resume"
        ) from error


SCRATCH_PID = re.compile(r"-pid(\d+)-")


def process_is_alive(pid: int) -> bool:
    """Whether a process of this id runs on this machine (a reused id reads as alive: kept)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def new_scratch_folder(prefix: str) -> str:
    """A new node-local folder for one worker's checkpoint files, named after this process.

    A worker killed while it held one (a lost node's, a preempted or OOM-killed worker) never
    removes it: each kill would leave a checkpoint's worth of disk behind (a 22M-parameter
    classifier's weights and AdamW state: 261 MB).
    So first remove the folders of this prefix whose processes are gone; a live worker's stay.
    """
    base = Path(tempfile.gettempdir())
    for folder in base.glob(f"{prefix}-pid*-*"):
        found = SCRATCH_PID.search(folder.name[len(prefix) :])
        if found and not process_is_alive(int(found.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}-pid{os.getpid()}-")


@contextmanager
def scratch_folder(prefix: str) -> Iterator[str]:
    """`new_scratch_folder`, removed on leaving."""
    folder = new_scratch_folder(prefix)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
