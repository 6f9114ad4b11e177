"""Fixed-size rows of a prepared split (a packed block of tokens, an image, a label) in one flat
node-local file, read by row index.

Training reads a few rows per step in a random order. Reading them from Parquet would decode whole
row groups; holding the split in memory grows with the dataset. So on first use each node writes
the split's rows into one file, one after the other (a stream over the Parquet's record batches:
memory bounded by one batch), and workers read each step's rows with `os.preadv`: a process holds
the rows it asked for, never the split.

Where the file lives: inside the split's folder when it is on a local or mounted disk that this
process may write (written once, beside the Parquet); otherwise (a bucket on S3 or GCS, a read-only
mount) in a node-local cache (`$RAYTRAIN_ROW_CACHE`, else `~/.cache/raytrain/rows`), downloaded once
per node: one sequential read of the split, and the rows' bytes of local disk. A fingerprint of the
Parquet files (names, sizes, times) names the file, so a re-prepared split gets a new one.
It is built once, and the file appears whole or not at all (written under a name of the builder's
own, then renamed; a build that fails removes what it wrote). Who builds is decided by a file
lock (`flock`, which Linux turns into a POSIX byte-range lock on NFS, so the server arbitrates it
between nodes): beside the data when the file is written there, so that on a shared mount one node
builds it for the cluster while the others wait and then read it; in a private folder of the
node's (mode 0700, ours, no symlinks) for a node-local cache, where only the node's processes meet.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_common.storage import StoragePath

CACHE_ENV = "RAYTRAIN_ROW_CACHE"
READ_BATCH_ROWS = 4096  # rows decoded at once while building

# A record batch of the split's Parquet → its rows as one array (n, *row shape).
RowsOf = Callable[[pa.RecordBatch], np.ndarray]


class RowSource(Protocol):
    """What a training loop reads rows through: a RowFile, or anything that takes rows by index."""

    def __len__(self) -> int: ...

    def take(self, indices: Sequence[int] | np.ndarray) -> np.ndarray: ...


class RowFile:
    """`rows` rows of `shape` and `dtype` in one file; `take(indices)` reads just those rows."""

    def __init__(self, path: Path, rows: int, shape: tuple[int, ...], dtype: str) -> None:
        self.path, self.rows, self.shape, self.dtype = path, rows, shape, np.dtype(dtype)
        self.row_bytes = math.prod(shape) * self.dtype.itemsize
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.rows

    def __del__(self) -> None:
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def take(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows `indices`, in that order, as an array (len(indices), *shape)."""
        out = np.empty((len(indices), *self.shape), dtype=self.dtype)
        if not len(indices):
            return out
        flat = out.reshape(len(indices), -1).view(np.uint8)
        for position, row in enumerate(indices):
            if not 0 <= row < self.rows:
                raise IndexError(f"row {row} of {self.rows} in {self.path}")
            read = os.preadv(self.fd, [flat[position]], int(row) * self.row_bytes)
            if read != self.row_bytes:
                raise OSError(f"{self.path}: short read at row {row} (truncated? delete it)")
        return out

    def read_all(self, chunk_rows: int = 65_536) -> Iterator[np.ndarray]:
        """Every row in order, a chunk at a time."""
        for start in range(0, self.rows, chunk_rows):
            yield self.take(np.arange(start, min(start + chunk_rows, self.rows)))


def row_file(
    split_dir: StoragePath, name: str, columns: list[str], rows_of: RowsOf, version: str
) -> RowFile:
    """The split's `name` rows on this node, built from its Parquet's `columns` on first use.
    `version` names how `rows_of` lays rows out: change it when that changes."""
    parquet = split_dir.list_files(".parquet")
    if not parquet:
        raise FileNotFoundError(f"no Parquet in {split_dir.uri}: rerun the pipeline's prepare")
    infos = split_dir.filesystem.get_file_info([file.path for file in parquet])
    source = [name, version, columns, [(i.base_name, i.size, i.mtime_ns) for i in infos]]
    fingerprint = hashlib.sha256(json.dumps(source).encode()).hexdigest()[:16]
    local = Path(split_dir.path)
    in_place = split_dir.is_local and os.access(local, os.W_OK)
    folder = local if in_place else cache_folder(split_dir)
    target = folder / f"{name}-{fingerprint}.rows"
    meta_file = target.with_suffix(".json")
    folder.mkdir(parents=True, exist_ok=True)
    # Beside the data every node that mounts it sees the lock: one build for the cluster. A cache
    # is the node's own: its lock is too.
    locks = folder if in_place else private_folder(Path(tempfile.gettempdir()) / LOCKS_FOLDER)
    with locked(locks / f".{target.name}.lock"):
        if not meta_file.exists():
            meta = write_rows(parquet, columns, rows_of, target)
            partial = meta_file.with_suffix(f".json.{own_suffix()}")
            partial.write_text(json.dumps(meta))
            os.replace(partial, meta_file)  # written last: its presence means the file is whole
    meta = json.loads(meta_file.read_text())
    shape = tuple(meta["shape"])
    expected = meta["rows"] * math.prod(shape) * np.dtype(meta["dtype"]).itemsize
    if target.stat().st_size != expected:
        raise OSError(
            f"{target} is {target.stat().st_size} bytes, not {meta['rows']} rows of {shape} "
            f"{meta['dtype']}: delete it and {meta_file.name}; the next run rebuilds them"
        )
    return RowFile(target, meta["rows"], shape, meta["dtype"])


LOCKS_FOLDER = f"raytrain-row-locks-{os.getuid()}"


def private_folder(folder: Path) -> Path:
    """`folder`, made if absent, refused unless it is a real folder of this user's that no one
    else may enter (mode 0700): in a shared /tmp, another user could otherwise make it first, or
    a symlink in its place, and hold our locks or redirect our files."""
    with suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    status = os.lstat(folder)
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise OSError(
            f"{folder} is not a private folder of this user's (a symlink, another user's, or open "
            f"to others: mode {stat.S_IMODE(status.st_mode):o}): remove it, or set TMPDIR to a "
            "folder of your own"
        )
    return folder


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (made if absent, never through a symlink); each caller
    opens its own descriptor, so threads of one process exclude each other too."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)  # the others wait here, then find the file built
        yield
    finally:
        os.close(descriptor)  # releases the lock


def cache_folder(split_dir: StoragePath) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "raytrain" / "rows")
    return root / hashlib.sha256(split_dir.uri.encode()).hexdigest()[:16]


def own_suffix() -> str:
    """A name of this process's own: on a shared mount whose locks do not reach across nodes, two
    nodes may build at once; each renames a whole, identical file into place."""
    return f"{socket.gethostname()}-{os.getpid()}.partial"


def write_rows(
    parquet: list[StoragePath], columns: list[str], rows_of: RowsOf, target: Path
) -> dict[str, object]:
    """Stream every file's rows into `target`, in the order the files and their rows come."""
    partial = target.with_suffix(f".rows.{own_suffix()}")
    rows, shape, dtype = 0, (), "uint8"
    try:
        with open(partial, "wb") as out:
            for file in parquet:
                with file.filesystem.open_input_file(file.path) as stream:
                    reader = pq.ParquetFile(stream)
                    for batch in reader.iter_batches(batch_size=READ_BATCH_ROWS, columns=columns):
                        array = np.ascontiguousarray(rows_of(batch))
                        out.write(array.tobytes())
                        rows, shape, dtype = rows + len(array), array.shape[1:], array.dtype.str
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)  # a build that failed leaves nothing behind
    return {"rows": rows, "shape": list(shape), "dtype": dtype}
