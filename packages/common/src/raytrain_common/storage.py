"""Where runs and data live: local folders, NFS mounts, s3:// and gs://, behind one pyarrow filesystem.

Ray Train writes checkpoints from every node to `RunConfig.storage_path`, so a path that only exists on
one node silently breaks multi-node runs. The checks here catch that, and an unwritable path, on the
driver before any worker starts.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

REMOTE_SCHEMES = ("s3", "gs", "gcs")

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
        # An object-store URI may end in options (?endpoint_override=…&region=…): keep them last.
        base, query = self.uri.split("?", 1) if "?" in self.uri else (self.uri, "")
        uri = posixpath.join(base, *parts) + (f"?{query}" if query else "")
        return StoragePath(self.filesystem, posixpath.join(self.path, *parts), uri)

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

    def __str__(self) -> str:
        return self.uri


def resolve_storage(location: str | os.PathLike[str]) -> StoragePath:
    """Turn a user's storage location into a filesystem and path; relative local paths become absolute."""
    text = os.fspath(location).strip()
    if not text:
        raise StorageError("storage path is empty: give a folder, an NFS mount, s3://… or gs://…")
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
    storage: StoragePath, num_nodes: int, *, assume_shared: bool = False
) -> None:
    """Refuse a node-local storage path when the cluster has several nodes.

    Workers on the other nodes would write their checkpoints to their own disks, where neither the
    driver nor a restarted run can find them.
    """
    if num_nodes <= 1 or assume_shared or is_shared(storage):
        return
    fs_type = mount_fs_type(storage.path) or "unknown"
    raise StorageError(
        f"storage path {storage.uri!r} is on this node's own disk (filesystem {fs_type}), but the Ray "
        f"cluster has {num_nodes} nodes: workers on the other nodes cannot write checkpoints there. "
        "Set --storage-path to storage every node shares: an NFS / ReadWriteMany volume mounted at "
        "the same path on every node, s3://bucket/prefix or gs://bucket/prefix. If this path is such "
        "a shared mount of a kind not recognised here, pass --storage-is-shared."
    )


def check_writable(storage: StoragePath) -> None:
    """Create the folder and write, then delete, a probe file; raise a clear error if either fails."""
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
