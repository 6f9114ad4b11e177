"""The node-local row file training reads from: the same rows as the Parquet in any order asked
for, built once per node in memory that does not grow with the split, refused when cut short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_common.rowfile import CACHE_ENV, row_file
from raytrain_common.storage import resolve_storage
from raytrain_testkit.pace import paced

WIDTH = 65


def write_split(folder: Path, parts: list[int], seed: int = 0) -> np.ndarray:
    """Parquet files of fixed-size token lists (as packing writes them); the rows, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for index, count in enumerate(parts):
        tokens = rng.integers(0, 50_000, size=(count, WIDTH), dtype=np.int32)
        column = pa.FixedSizeListArray.from_arrays(pa.array(tokens.ravel()), WIDTH)
        labels = pa.array(tokens[:, 0] % 7)
        pq.write_table(
            pa.table({"input_ids": column, "label": labels}), folder / f"part-{index:03d}.parquet"
        )
        rows.append(tokens)
    return np.concatenate(rows)


def token_rows(batch: pa.RecordBatch) -> np.ndarray:
    column = batch.column(0)
    tokens = column.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    return tokens.reshape(len(column), column.type.list_size)


def tokens(split: Path) -> object:
    return row_file(resolve_storage(split), "blocks", ["input_ids"], token_rows, "int32-v1")


def test_rows_read_by_index_are_the_parquet_rows(tmp_path: Path) -> None:
    expected = write_split(tmp_path / "train", [700, 5000, 3])
    blocks = tokens(tmp_path / "train")
    assert len(blocks) == len(expected) and blocks.shape == (WIDTH,)
    picked = np.random.default_rng(1).permutation(len(expected))[:257]
    np.testing.assert_array_equal(blocks.take(picked), expected[picked])
    np.testing.assert_array_equal(np.concatenate(list(blocks.read_all(1000))), expected)
    assert blocks.take([]).shape == (0, WIDTH)
    with pytest.raises(IndexError):
        blocks.take(np.array([len(expected)]))
    # Scalar rows (a label per row) work the same way.
    labels = row_file(
        resolve_storage(tmp_path / "train"),
        "labels",
        ["label"],
        lambda batch: batch.column(0).to_numpy().astype(np.int64),
        "int64-v1",
    )
    np.testing.assert_array_equal(labels.take(picked), expected[picked, 0] % 7)


def test_built_once_per_node_and_again_for_a_new_split(tmp_path: Path) -> None:
    split = tmp_path / "train"
    write_split(split, [300, 300])
    built: list[Path] = []
    workers = [threading.Thread(target=lambda: built.append(tokens(split).path)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(set(built)) == 1 and len(list(split.glob("blocks-*.rows"))) == 1
    assert not [p for p in split.iterdir() if p.name.endswith(".partial")]
    modified = built[0].stat().st_mtime_ns
    assert tokens(split).path.stat().st_mtime_ns == modified  # reused, not rebuilt
    expected = write_split(split, [301, 300], seed=5)  # prepared again: other files
    again = tokens(split)
    assert again.path != built[0]
    np.testing.assert_array_equal(again.take(np.arange(len(expected))), expected)


READ_ONLY_CHECK = """
import sys
from pathlib import Path
import numpy as np
from raytrain_common.rowfile import row_file
from raytrain_common.storage import resolve_storage
sys.path.insert(0, sys.argv[3])
from test_rowfile import token_rows, WIDTH
split, cache = Path(sys.argv[1]), Path(sys.argv[2])
blocks = row_file(resolve_storage(split), "blocks", ["input_ids"], token_rows, "int32-v1")
assert blocks.path.is_relative_to(cache), blocks.path
np.save(sys.stdout.buffer, blocks.take(np.arange(120)))
"""


def as_unprivileged_user() -> list[str]:
    """The command prefix that runs a process as `nobody` when this one is root (CI's user, who
    writes into read-only folders): setpriv drops the uid, the groups and every capability."""
    if os.geteuid() != 0:
        return []
    nobody = "65534"
    return [
        "setpriv",
        f"--reuid={nobody}",
        f"--regid={nobody}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ]


def test_a_read_only_split_is_cached_on_the_node() -> None:
    """A split in a folder its reader cannot write (a read-only volume, another user's files): the
    row file is built in the node's cache folder (CACHE_ENV) instead, with the same rows. Run as an
    unprivileged user, also when the tests run as root."""
    import io
    import shutil
    import tempfile

    # Not under pytest's tmp_path: root's is closed to other users.
    root = Path(tempfile.mkdtemp(prefix="read-only-split-"))
    try:
        split, cache = root / "data" / "train", root / "cache"
        expected = write_split(split, [120])
        cache.mkdir()
        if os.geteuid() == 0:
            for path in [root, *root.rglob("*")]:
                os.chown(path, 65534, 65534)
        split.chmod(0o555)
        done = subprocess.run(
            [
                *as_unprivileged_user(),
                sys.executable,
                "-c",
                READ_ONLY_CHECK,
                str(split),
                str(cache),
                str(Path(__file__).parent),
            ],
            capture_output=True,
            env={**os.environ, CACHE_ENV: str(cache)},
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        np.testing.assert_array_equal(np.load(io.BytesIO(done.stdout)), expected)
    finally:
        split.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)


def test_a_truncated_row_file_is_refused_naming_what_to_delete(tmp_path: Path) -> None:
    split = tmp_path / "train"
    write_split(split, [50])
    path = tokens(split).path
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(OSError, match="delete it"):
        tokens(split)


MEASURE = """
import resource, sys
import numpy as np
import pyarrow as pa
from raytrain_common.rowfile import row_file
from raytrain_common.storage import resolve_storage

def token_rows(batch):
    column = batch.column(0)
    return column.flatten().to_numpy(zero_copy_only=False).astype(np.int32).reshape(
        len(column), column.type.list_size)

if sys.argv[2] == "build":
    rows = row_file(resolve_storage(sys.argv[1]), "blocks", ["input_ids"], token_rows, "int32-v1")
    for step in range(200):
        rows.take(np.random.default_rng(step).integers(0, len(rows), 32))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_building_and_reading_hold_memory_that_does_not_grow_with_the_split(
    tmp_path: Path,
) -> None:
    """A 10.6 M-token split in files of 8,192 blocks, as packing writes them (43 MB as int32; read
    whole as int64 it took 85 MB, plus Arrow's copy): building its file and reading 200 steps of 32
    rows peaks within 24 MB of a process that only imports the same modules."""
    split = tmp_path / "train"
    write_split(split, [8192] * 20)  # 163,840 rows × 65 tokens
    file_bytes = 163_840 * WIDTH * 4

    def peak(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", MEASURE, str(split), mode],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(done.stdout.strip())

    growth = peak("build") - peak("import")
    assert growth < 24 * 2**20 < file_bytes, f"peak RSS grew by {growth / 2**20:.0f} MiB"
    assert json.loads(next(split.glob("blocks-*.json")).read_text())["rows"] == 163_840


BUILD_IN_PROCESS = """
import os, sys, time
import numpy as np
from raytrain_common.rowfile import row_file
from raytrain_common.storage import resolve_storage

def rows(batch):
    with open(sys.argv[2], "a") as log:  # one line per batch this process builds
        log.write(f"{os.getpid()}\\n")
    time.sleep(0.2)  # a slow build: the other processes arrive while it runs
    column = batch.column(0)
    return column.flatten().to_numpy(zero_copy_only=False).astype(np.int32).reshape(len(column), -1)

found = row_file(resolve_storage(sys.argv[1]), "blocks", ["input_ids"], rows, "int32-v1")
print(found.path, len(found))
"""


def test_a_split_in_a_shared_folder_is_built_by_one_process_of_all_that_mount_it(
    tmp_path: Path,
) -> None:
    """Four processes (as four nodes mounting one NFS folder) ask for the same split's row file at
    once: the lock beside the data lets one of them build it; the others wait and read that file."""
    split, log = tmp_path / "shared" / "train", tmp_path / "builds.log"
    write_split(split, [300, 300])
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD_IN_PROCESS, str(split), str(log)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    answers = {process.communicate(timeout=paced(120))[0].strip() for process in processes}
    assert all(process.returncode == 0 for process in processes)
    assert len(answers) == 1 and answers.pop().endswith(" 600")
    builders = set(log.read_text().split())
    assert len(builders) == 1, f"{len(builders)} processes built the file"
    assert len(list(split.glob("blocks-*.rows"))) == 1
    assert not [p for p in split.iterdir() if ".partial" in p.name]


def test_node_local_locks_live_in_a_private_folder_and_a_planted_one_is_refused(
    tmp_path: Path,
) -> None:
    """A lock folder another user made first, opened to others, or planted as a symlink is refused;
    a folder of our own is made with mode 0700."""
    from raytrain_common.rowfile import private_folder

    made = private_folder(tmp_path / "locks")
    assert made.stat().st_mode & 0o777 == 0o700
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "planted").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="not a private folder"):
        private_folder(tmp_path / "planted")
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(OSError, match=r"mode 777"):
        private_folder(tmp_path / "open")
