"""Where runs and data live: local folders, NFS mounts, s3:// and gs://, behind one pyarrow
filesystem.

Ray Train writes checkpoints from every node to `RunConfig.storage_path`, so a path that only exists
on one node silently breaks multi-node runs. The checks here catch that, and an unwritable path, on
the driver before any worker starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import posixpath
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

REMOTE_SCHEMES = ("s3", "gs", "gcs")
# Schemes a user may mean when a location starts with `scheme:` but lacks the `//`.
URI_LIKE_SCHEMES = (*REMOTE_SCHEMES, "file", "hdfs", "http", "https", "abfs", "az", "gcs")
_MISSPELT_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/?)(?!/)")

# Filesystem types (as /proc/mounts names them) that every node of a cluster can mount at once.
SHARED_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "cephfs",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.gcsfuse",
        "fuse.s3fs",
        "fuse.mountpoint-s3",
        "fuse.juicefs",
        "fuse.cephfs",
        "wekafs",
    }
)


class StorageError(ValueError):
    """A storage path that cannot serve this run; the message says what to set instead."""


# Storage errors that waiting does not cure: retrying them is 300 s lost before the same failure.
LASTING_ERRNOS = {
    errno.ENOSPC: "is full (no space left on device)",
    errno.EDQUOT: "is over its disk quota",
    errno.EROFS: "is read-only",
}  # not EACCES: an object store's expired credentials may be renewed while the upload retries
_LASTING_TEXT = {
    "No space left on device": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
    "Read-only file system": errno.EROFS,
}


def lasting_storage_problem(error: BaseException) -> str | None:
    """What makes a storage path unwritable until someone acts (full, over quota, read-only),
    found on `error` or its causes by errno or by the kernel's text; None for an outage worth
    retrying (a network error, an object store endpoint down)."""
    seen: BaseException | None = error
    while seen is not None:
        code = getattr(seen, "errno", None)
        if code in LASTING_ERRNOS:
            return LASTING_ERRNOS[code]
        for text, code in _LASTING_TEXT.items():
            if text in str(seen):
                return LASTING_ERRNOS[code]
        seen = seen.__cause__ or seen.__context__
    return None


# Query parameters that carry a secret in the URIs users pass (pyarrow's S3 and GCS URIs take
# access_key / secret_key / session_token; presigned and SAS URLs carry signatures and tokens).
SECRET_QUERY_KEYS = re.compile(
    r"(?i)password|passwd|secret|token|signature|credential|^access_key$|^sig$|^key$|^x-amz-"
)


def redact_uri(uri: str) -> str:
    """`uri` fit for a log line: a password in its user info and every query value that carries a
    secret replaced by `***` (postgresql://ml:***@db/mlflow, s3://b/p?access_key=***). Anything
    that is not a URI with those parts comes back unchanged."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    netloc = parts.netloc
    if "@" in netloc:
        user_info, host = netloc.rsplit("@", 1)
        user = user_info.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in user_info else f"***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        hidden = [(k, "***" if SECRET_QUERY_KEYS.search(k) else v) for k, v in pairs]
        query = urlencode(hidden, safe="*/:")
    if (netloc, query) == (parts.netloc, parts.query):
        return uri
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def redact_uri_in(text: str, uri: str) -> str:
    """`text` (an error's message, say) with every copy of `uri` in it redacted."""
    return text.replace(uri, redact_uri(uri)) if uri else text


def join_uri(uri: str, *parts: str) -> str:
    """`uri`/parts, its options (?endpoint_override=…&region=… of an object store) kept last: the
    one way every command computes a folder under the storage path (`posixpath.join` would put the
    parts after the options)."""
    base, query = uri.split("?", 1) if "?" in uri else (uri, "")
    return posixpath.join(base, *parts) + (f"?{query}" if query else "")


@dataclass(frozen=True)
class StoragePath:
    """A location on some filesystem: `uri` is what users see, `path` is what `filesystem` takes."""

    filesystem: pafs.FileSystem
    path: str
    uri: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    def join(self, *parts: str) -> StoragePath:
        return StoragePath(
            self.filesystem, posixpath.join(self.path, *parts), join_uri(self.uri, *parts)
        )

    def uri_for(self, path: str) -> str:
        """The URI of another `path` on this filesystem (Ray reports checkpoint paths without a
        scheme), with this location's scheme and options, so a user can pass it back as is."""
        if self.is_local:
            return path
        scheme = self.uri.split("://", 1)[0]
        query = self.uri.split("?", 1)[1] if "?" in self.uri else ""
        return f"{scheme}://{path.lstrip('/')}" + (f"?{query}" if query else "")

    def exists(self) -> bool:
        return self.filesystem.get_file_info(self.path).type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self.filesystem.get_file_info(self.path).type == pafs.FileType.Directory

    def mkdir(self) -> None:
        self.filesystem.create_dir(self.path, recursive=True)

    def read_bytes(self) -> bytes:
        with self.filesystem.open_input_stream(self.path) as stream:
            return stream.read()

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def write_bytes(self, data: bytes) -> None:
        """Write the whole file or nothing: readers never see a half-written file."""
        write_atomic(self, lambda stream: stream.write(data))

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode("utf-8"))

    def list_files(self, suffix: str = "") -> list[StoragePath]:
        """Files directly in this folder, sorted by name; hidden and temporary files left out."""
        selector = pafs.FileSelector(self.path, allow_not_found=True)
        infos = self.filesystem.get_file_info(selector)
        names = sorted(
            info.base_name
            for info in infos
            if info.type == pafs.FileType.File
            and info.base_name.endswith(suffix)
            and not info.base_name.startswith((".", "_"))
        )
        return [self.join(name) for name in names]

    def walk_files(self) -> list[tuple[str, StoragePath]]:
        """Every file under this folder at any depth as (path relative to it, file), sorted by
        relative path; hidden files and folders (a leading dot: .git, .DS_Store) left out."""
        selector = pafs.FileSelector(self.path, allow_not_found=True, recursive=True)
        found = []
        for info in self.filesystem.get_file_info(selector):
            if info.type != pafs.FileType.File:
                continue
            relative = posixpath.relpath(info.path, self.path)
            if any(part.startswith(".") for part in relative.split("/")):
                continue
            found.append((relative, self.join(*relative.split("/"))))
        return sorted(found, key=lambda pair: pair[0])

    def __str__(self) -> str:
        return self.uri


def resolve_storage(location: str | os.PathLike[str]) -> StoragePath:
    """Turn a user's storage location into a filesystem and path; relative local paths become
    absolute."""
    text = os.fspath(location).strip()
    if not text:
        raise StorageError("storage path is empty: give a folder, an NFS mount, s3://… or gs://…")
    misspelt = _MISSPELT_URI.match(text)
    if misspelt and misspelt.group(1).lower() in URI_LIKE_SCHEMES:
        # `s3:/bucket` would otherwise become a local folder named `s3:`, silently.
        scheme, rest = misspelt.group(1), text[misspelt.end() :]
        raise StorageError(
            f"storage path {text!r} looks like a {scheme} URI without its '//': write "
            f"{scheme}://{rest} (or ./{text} for a local folder of that name)"
        )
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme == "file":
            text = text[len("file://") :]
        elif scheme not in REMOTE_SCHEMES:
            raise StorageError(
                f"storage path {text!r} has scheme {scheme!r}, which this project does not handle: "
                "use a local or NFS folder, s3://bucket/prefix or gs://bucket/prefix"
            )
        else:
            filesystem, path = pafs.FileSystem.from_uri(text)
            return StoragePath(filesystem, path.rstrip("/"), text)
    absolute = str(Path(text).expanduser().resolve())
    return StoragePath(pafs.LocalFileSystem(), absolute, absolute)


def write_atomic(target: StoragePath, write: Callable[[pafs.NativeFile], object]) -> None:
    """Run `write` on a stream that becomes `target` only once it is complete.

    Locally that is a temporary sibling renamed over the target; object stores (S3, GCS) publish an
    object only when its upload closes, so there the stream goes straight to the target.
    """
    parent = posixpath.dirname(target.path)
    if parent:
        target.filesystem.create_dir(parent, recursive=True)
    if not target.is_local:
        with target.filesystem.open_output_stream(target.path) as stream:
            write(stream)
        return
    temporary = f"{parent}/.{posixpath.basename(target.path)}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with target.filesystem.open_output_stream(temporary) as stream:
            write(stream)
        os.replace(temporary, target.path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_folder_whole(target: StoragePath, write: Callable[[StoragePath], object]) -> None:
    """Run `write` on a folder that becomes `target` only once `write` has returned (a Ray
    Dataset's `write_parquet`, say): locally a sibling folder renamed into place, so a stopped
    command leaves no half output under the target's name (the sibling stays, named
    `*.partial-*`). Object stores have no folder rename: there `write` fills the target's prefix
    as it goes."""
    if not target.is_local:
        write(target)
        return
    staging = resolve_storage(f"{target.path}.partial-{uuid.uuid4().hex[:8]}")
    write(staging)
    os.replace(staging.path, target.path)


def mount_fs_type(path: str) -> str:
    """The filesystem type of the mount holding `path` ("" when /proc/mounts is unreadable)."""
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            entries = [line.split() for line in mounts]
    except OSError:
        return ""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    real = os.path.realpath(existing)
    best_point, best_type = "", ""
    for entry in entries:
        if len(entry) < 3:
            continue
        point = entry[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best_point):
            best_point, best_type = point, entry[2]
    return best_type


def is_shared(storage: StoragePath) -> bool:
    """True when every node of a cluster can reach `storage`: an object store or a network mount."""
    return not storage.is_local or mount_fs_type(storage.path) in SHARED_FS_TYPES


def check_shared_for_cluster(
    storage: StoragePath, num_nodes: int, *, assume_shared: bool = False, reads: str | None = None
) -> None:
    """Refuse a node-local path when the cluster has several nodes.

    For the storage path: workers on the other nodes would write their checkpoints to their own
    disks, where neither the driver nor a restarted run can find them. For an input (`reads`
    names it: a data folder, an image tree): tasks and workers on the other nodes would not find
    its files, and fail on the first one with a bare FileNotFoundError.
    """
    if num_nodes <= 1 or assume_shared or is_shared(storage):
        return
    fs_type = mount_fs_type(storage.path) or "unknown"
    shared = (
        "an NFS / ReadWriteMany volume mounted at the same path on every node, s3://bucket/prefix "
        "or gs://bucket/prefix. If this path is such a shared mount of a kind not recognised "
        "here, pass --storage-is-shared."
    )
    if reads is not None:
        raise StorageError(
            f"{reads} {storage.uri!r} is on this node's own disk (filesystem {fs_type}), but the "
            f"Ray cluster has {num_nodes} nodes: Ray Data tasks and workers on the other nodes "
            f"cannot read it. Put it on storage every node shares: {shared}"
        )
    raise StorageError(
        f"storage path {storage.uri!r} is on this node's own disk (filesystem {fs_type}), but the "
        f"Ray cluster has {num_nodes} nodes: workers on the other nodes cannot write checkpoints "
        f"there. Set --storage-path to storage every node shares: {shared}"
    )


def check_writable(storage: StoragePath) -> None:
    """Create the folder and write, then delete, a probe file; raise a clear error if either
    fails."""
    probe = storage.join(f".write-probe-{uuid.uuid4().hex[:8]}")
    try:
        storage.mkdir()
        with storage.filesystem.open_output_stream(probe.path) as stream:
            stream.write(b"ok")
        storage.filesystem.delete_file(probe.path)
    except OSError as error:
        raise StorageError(
            f"storage path {storage.uri!r} is not writable ({error}). Point --storage-path at a "
            "folder you can write to (for a bucket, check the credentials in the environment)."
        ) from error


def restart_marked_folder(folder: StoragePath, marker: str) -> StoragePath:
    """Empty `folder` for a new output whose `marker` file, written last, says it is complete; the
    old marker goes first, so an output cut off halfway is never taken for a finished one. Returns
    the marker's path, for the writer to write once everything else is written."""
    marker_path = folder.join(marker)
    if marker_path.exists():
        marker_path.filesystem.delete_file(marker_path.path)
    if folder.exists():
        folder.filesystem.delete_dir_contents(folder.path)
    folder.mkdir()
    return marker_path


FILES_IN = "files_in"  # a marker's field: where the output's files lie, relative to its folder


@dataclass(frozen=True)
class OutputMarker:
    """The file that marks a folder as one command's complete output, written last, and the
    JSON fields it holds. `--force` replaces a folder only when its marker is one of these: a
    JSON object with the `required` fields and none outside `allowed`."""

    name: str
    required: frozenset[str]
    allowed: frozenset[str]

    @classmethod
    def of(cls, name: str, record: type) -> OutputMarker:
        """The marker named `name` that holds a `record` dataclass (its fields without a default
        are required)."""
        fields = dataclasses.fields(record)
        required = {
            field.name
            for field in fields
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        }
        allowed = {field.name for field in fields} | {FILES_IN}
        return cls(name, frozenset(required), frozenset(allowed))

    def is_ours(self, marker_path: StoragePath) -> bool:
        try:
            record = json.loads(marker_path.read_text())
        except (ValueError, UnicodeDecodeError):  # not JSON: cut short, or someone else's
            return False
        return isinstance(record, dict) and self.required <= set(record) <= self.allowed


def files_of(folder: StoragePath, files_in: str) -> StoragePath:
    """Where an output's files lie: `folder` itself, or the generation its marker names (an
    object store's output, `staged_output`)."""
    return folder.join(files_in) if files_in else folder


def check_output_folder(target: StoragePath, marker: OutputMarker) -> None:
    """Refuse a folder of the user's own files as an output, before any work is done: one without
    the marker that holds any file (a hidden one too: `.git`, `.env`), or one whose marker this
    command did not write (another command's, or not what this command writes)."""
    if not target.is_dir():
        return
    marker_path = target.join(marker.name)
    if marker_path.exists():
        if marker.is_ours(marker_path):
            return
        raise StorageError(
            f"{target.uri} holds a {marker.name} this command did not write, so it is not an "
            "output of this command (--force replaces only its own): choose a new or empty folder "
            "to write to"
        )
    selector = pafs.FileSelector(target.path, allow_not_found=True, recursive=True)
    held = [
        info.path
        for info in target.filesystem.get_file_info(selector)
        if info.type == pafs.FileType.File
    ]
    if held:
        hidden = all(
            any(part.startswith(".") for part in posixpath.relpath(path, target.path).split("/"))
            for path in held
        )
        raise StorageError(
            f"{target.uri} holds {'hidden files only' if hidden else 'files'} but no "
            f"{marker.name}, so it is not an output of this command: choose a new or empty folder "
            "to write to"
        )


@dataclass(frozen=True)
class StagedOutput:
    """Where a command writes an output that replaces `target` only once it is complete."""

    folder: StoragePath  # every file of the output goes here
    files_in: str  # the marker records it: where the files lie relative to the target
    marker: StoragePath  # written last, by write_marker

    def write_marker(self, record: dict[str, Any]) -> None:
        """Write the marker (last: on an object store this one PUT is what swaps the outputs)."""
        self.marker.write_text(json.dumps({**record, FILES_IN: self.files_in}, indent=2) + "\n")


@contextlib.contextmanager
def staged_output(target: StoragePath, marker: OutputMarker) -> Iterator[StagedOutput]:
    """An output written whole, which replaces `target` only if the block completes and writes
    the marker; the one rule every `prepare` and `export` follows.

    `target` may be absent, empty, or an earlier output of this command (its marker is ours); a
    folder of anything else is refused before any work, so the user's own files are never replaced.

    Locally the files go to a hidden sibling that replaces `target` by a rename at the end and is
    deleted on an error. Object stores have no rename: there the files go to a new generation
    folder inside `target` (`files-<time>-<id>`), the old output untouched and still marked, and
    the marker, rewritten last in one PUT, names the new generation; only then are the old
    output's files deleted. A refused, failed or killed `--force` leaves the old output usable
    (a killed one leaves its partial generation, which the next completed write deletes).
    """
    check_output_folder(target, marker)
    if target.is_local:
        with _staged_locally(target) as staging:
            staged = StagedOutput(staging, "", staging.join(marker.name))
            yield staged
            _check_marked(staged)
        return
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    files_in = f"files-{stamp}-{uuid.uuid4().hex[:6]}"
    staged = StagedOutput(target.join(files_in), files_in, target.join(marker.name))
    try:
        yield staged
        _check_marked(staged)
    except BaseException:
        with contextlib.suppress(OSError):  # best effort: the next completed write deletes it
            target.filesystem.delete_dir(staged.folder.path)
        raise
    selector = pafs.FileSelector(target.path, allow_not_found=True)
    for info in target.filesystem.get_file_info(selector):
        if info.base_name in (files_in, marker.name):
            continue
        if info.type == pafs.FileType.Directory:
            target.filesystem.delete_dir(info.path)
        else:
            target.filesystem.delete_file(info.path)


def _check_marked(staged: StagedOutput) -> None:
    """The block's own marker is in place (not an earlier output's, whose files would go)."""
    written = staged.marker.exists() and json.loads(staged.marker.read_text())
    if not written or written.get(FILES_IN) != staged.files_in:
        raise RuntimeError(f"the output in {staged.folder.uri} was completed without its marker")


@contextlib.contextmanager
def _staged_locally(target: StoragePath) -> Iterator[StoragePath]:
    """A hidden sibling of `target` that replaces it by a rename when the block completes, and
    is deleted (with any parent folder this call created) when it fails."""
    parent, name = posixpath.split(target.path)
    created = Path(parent)  # the outermost folder this call creates, removed again on a failure
    while not created.parent.exists():
        created = created.parent
    created_any = not created.exists()
    os.makedirs(parent, exist_ok=True)
    staging_path = posixpath.join(parent, f".{name}.partial-{uuid.uuid4().hex[:8]}")
    staging = StoragePath(target.filesystem, staging_path, staging_path)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging_path, ignore_errors=True)
        if created_any and not any(p.is_file() for p in created.rglob("*")):
            shutil.rmtree(created, ignore_errors=True)
        raise
    try:
        if os.path.exists(target.path):
            retired = posixpath.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(target.path, retired)
            os.rename(staging_path, target.path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging_path, target.path)
    finally:
        shutil.rmtree(staging_path, ignore_errors=True)
