"""`prepare` of a source that is already shards, local, NFS, s3:// or gs://:
WebDataset tars (each sample an image member and a `.cls` member holding its class, as
`webdataset` writes them) or Parquet files of encoded images (a binary column, or Hugging Face's
`{bytes, path}` struct) with a label column. The output is what `prepare --shards` writes for a
tree: Parquet files of 1,000 images each, encoded as they were, every one a uniform sample of
its split, rows numbered in a seeded random order.

- The driver lists the shard files, not the images: a split's folder (train/, test/, val/ as a
  tree has them) or the source's top, read at any depth.
- Ray Data reads each shard in one task (`scan_shard`): every sample's image decoded once
  (images.check_image) and its class read; the rows it yields carry no bytes, only where the
  sample is (`path`: "<shard>#<key>"), its class, and the check's outcome. The list is
  materialised in Ray's object store (~150 bytes an image).
- From there it is a tree's plan (tree_prep.py): the same counters, refusals, stratified carve
  and seeded order, each class's smallest hashes held out. The driver streams that order and
  puts each output shard's rows into the object store (a reference per 1,000 images).
- The bytes then move once, in two Ray Data shuffles: the rows grouped by source shard
  (`copy_samples`: a task reads its shard again and attaches each sample's bytes), then by output
  shard (`write_group`: a task writes one Parquet file, its rows in order). That all-to-all is
  what turns class-sorted shards (a tar per class is common) into shards that are each a uniform
  sample, which training's cheap per-epoch order relies on (`images.stream`).

Not Ray Data's `read_webdataset`: it yields each sample's bytes with no way to know which shard
and member a row came from, so a sample could not be named in bad_files.csv nor found again
without carrying every image through the materialised list. Not `Dataset.join` for the bytes: in
Ray 2.60 it needs polars, one more package on every node for one step.
"""

from __future__ import annotations

import functools
import io
import posixpath
import tarfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from raytrain_common.images import files as image_files
from raytrain_common.images.dataset import DataError
from raytrain_common.images.tree import (
    IMAGE,
    LIST_PAGE,
    ORDER_KEY,
    OTHER,
    CheckedTree,
    Layout,
    check_classes,
    entries,
    path_id,
    refuse_bad_share,
    refuse_unusable,
    seed_key,
    split_folders,
    summarise_checked,
    walk,
)
from raytrain_common.storage import StoragePath, join_uri

WEBDATASET, PARQUET = ".tar", ".parquet"  # a shard source's format, by its files' suffix
TAR_READ_BUFFER = 8 << 20  # bytes a read of a tar asks its storage for
CLASS_MEMBER = "cls"  # a WebDataset sample's class: a member `<key>.cls` holding it as text


def shard_format(root: StoragePath) -> str | None:
    """WEBDATASET or PARQUET when the source's top (or its train/ folder) holds such files, else
    None (an image tree, an IDX folder, a file); both kinds at once are refused."""
    if not root.is_dir():
        return None
    folders, files = entries(root)
    train = next((name for name in folders if name.lower() == "train"), None)
    if train is not None:
        files = files + entries(root.join(train))[1]
    found = {posixpath.splitext(name)[1].lower() for name in files} & {WEBDATASET, PARQUET}
    if len(found) > 1:
        raise DataError(
            f"{root} holds both .tar and .parquet shards: give one kind as --source (a folder of "
            "WebDataset tars, or of Parquet files with an image and a label column)"
        )
    return found.pop() if found else None


def find_shards(root: StoragePath, suffix: str) -> tuple[Layout, list[dict[str, str]]]:
    """The splits (train/, test/ and val/ folders as a tree has them, or "all": carved) and every
    shard file under each, at any depth, in name order."""
    roots = split_folders(root)
    shards = [
        {"split": split, "shard": path}
        for split, prefix in roots.items()
        for path in walk(root, prefix)
        if path.lower().endswith(suffix)
    ]
    for split, prefix in roots.items():
        if not any(shard["split"] == split for shard in shards):
            raise DataError(f"{root.join(prefix) if prefix else root} holds no {suffix} shard")
    return Layout({split: {} for split in roots}, roots), shards


# ---------------------------------------------------------------------------------------------
# Reading a shard: (key, image bytes or None, class text or None, a member's name)
# ---------------------------------------------------------------------------------------------

# What reading a shard that is truncated, not a tar, not Parquet or without the columns raises.
SHARD_ERRORS = (OSError, EOFError, tarfile.TarError, pa.ArrowException, DataError)
Sample = tuple[str, bytes | None, str | None, str]
Checked = tuple[str, str, str, int, str, str]  # class_name, path, kind, side, mode, error


# The most a tar member may hold: one image (an 8192×8192 RGB image, the pixel limit, is 192 MiB
# even uncompressed) or its class. A member's size comes from its header, so a crafted or
# corrupted tar could otherwise make a task read gigabytes into memory for one sample.
MAX_TAR_MEMBER_BYTES = 256 * 2**20


def tar_samples(stream: Any) -> Iterator[Sample]:
    """A WebDataset tar's samples, streamed: members sharing a key (the name up to the first dot of
    its base name) are consecutive; the first image member is the image. A member larger than
    MAX_TAR_MEMBER_BYTES ends the shard's reading with a DataError naming it (never read)."""
    key: str | None = None
    image: bytes | None = None
    label: str | None = None
    first = ""
    with tarfile.open(fileobj=stream, mode="r|*") as archive:
        for member in archive:
            if not member.isfile():
                continue
            folder, base = posixpath.split(member.name)
            stem, _, extension = base.partition(".")
            member_key = posixpath.join(folder, stem)
            if member_key != key:
                if key is not None:
                    yield key, image, label, first
                key, image, label, first = member_key, None, None, member.name
            if member.size > MAX_TAR_MEMBER_BYTES:
                raise DataError(
                    f"member {member.name} holds {member.size / 2**20:,.0f} MiB, over the limit of "
                    f"{MAX_TAR_MEMBER_BYTES / 2**20:.0f} MiB per member (one image or its class): "
                    "not a WebDataset shard of images, or a damaged one"
                )
            data = archive.extractfile(member)
            assert data is not None  # a regular file
            if extension.lower() == CLASS_MEMBER:
                label = data.read().decode("utf-8", "replace").strip()
            elif image is None and f".{extension.lower()}" in image_files.IMAGE_SUFFIXES:
                image = data.read()
    if key is not None:
        yield key, image, label, first


def image_bytes(value: Any) -> bytes | None:
    """A Parquet image cell: bytes, or Hugging Face's {"bytes": …, "path": …} struct."""
    if isinstance(value, dict):
        value = value.get("bytes")
    return bytes(value) if value is not None else None


def parquet_samples(
    handle: Any, image_column: str, label_column: str, where: str
) -> Iterator[Sample]:
    """A Parquet file's rows as samples, a row group at a time; the key is the row's index."""
    import pyarrow.parquet as pq

    reader = pq.ParquetFile(handle)
    names = reader.schema_arrow.names
    missing = [column for column in (image_column, label_column) if column not in names]
    if missing:
        raise DataError(
            f"{where} has no column {missing[0]!r} (it has {names}): name the encoded images with "
            "--image-column and the classes with --label-column"
        )
    index = 0
    for batch in reader.iter_batches(batch_size=256, columns=[image_column, label_column]):
        for value, label in zip(
            batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True
        ):
            yield str(index), image_bytes(value), None if label is None else str(label), ""
            index += 1


def samples_of(
    root: StoragePath, shard: str, image_column: str, label_column: str
) -> Iterator[Sample]:
    location = root.join(*shard.split("/"))
    if shard.lower().endswith(WEBDATASET):
        # Read front to back in large reads: tarfile asks for 10 KiB at a time, and on S3 or GCS
        # an unbuffered read is a request (a 1 GB tar: ~100,000 of them).
        with location.filesystem.open_input_stream(
            location.path, compression=None, buffer_size=TAR_READ_BUFFER
        ) as stream:
            yield from tar_samples(stream)
        return
    with location.filesystem.open_input_file(location.path) as handle:  # Parquet: random access
        yield from parquet_samples(handle, image_column, label_column, location.uri)


# ---------------------------------------------------------------------------------------------
# Ray Data tasks
# ---------------------------------------------------------------------------------------------


def scan_shard(
    batch: dict[str, np.ndarray], root_uri: str, seed: int, image_column: str, label_column: str
) -> Iterator[dict[str, np.ndarray]]:
    """One shard → its samples checked, LIST_PAGE rows to a block, in `tree`'s checked-list
    columns (split, class_name, path, kind, id, order_key, side, mode, error): no bytes."""
    from raytrain_common.images.decode import image_root
    from raytrain_common.images.files import check_image

    root = image_root(root_uri)
    order = seed_key(seed, ORDER_KEY)
    for split, shard in zip(batch["split"], batch["shard"], strict=True):
        rows: list[Checked] = []
        read = 0
        try:
            for key, data, label, member in samples_of(
                root, str(shard), image_column, label_column
            ):
                rows.append(checked_sample(str(shard), key, data, label, member, check_image))
                read += 1
                if len(rows) == LIST_PAGE:
                    yield page(rows, str(split), order)
                    rows = []
        except SHARD_ERRORS as error:  # a truncated or foreign file: one bad entry, as a tree's
            why = f"{type(error).__name__}: {error}"
            rows.append(("", str(shard), IMAGE, 0, "", f"unreadable after {read} samples ({why})"))
        if rows:
            yield page(rows, str(split), order)


def checked_sample(
    shard: str, key: str, data: bytes | None, label: str | None, member: str, check: Any
) -> Checked:
    """One sample's row of the checked list, its image decoded whole (`check`)."""
    if data is None:  # no image member: counted by its first member's suffix, as a tree's files
        return "", f"{shard}#{member or key}", OTHER, 0, "", ""
    path = f"{shard}#{key}"
    if not label:
        return "", path, IMAGE, 0, "", f"no class: its .{CLASS_MEMBER} member or label is missing"
    try:
        side, mode = check(io.BytesIO(data))
    except (OSError, ValueError, SyntaxError) as error:  # PIL's decoders raise all three
        return label, path, IMAGE, 0, "", f"{type(error).__name__}: {error}"
    return label, path, IMAGE, side, mode, ""


def page(rows: list[Checked], split: str, order: bytes) -> dict[str, np.ndarray]:
    names, paths, kinds, sides, modes, errors = (list(column) for column in zip(*rows, strict=True))
    return {
        "split": np.full(len(rows), split, dtype=object),
        "class_name": np.array(names, dtype=object),
        "path": np.array(paths, dtype=object),
        "kind": np.array(kinds, dtype=object),
        "id": np.fromiter((path_id(path) for path in paths), np.int64, len(rows)),
        "order_key": np.fromiter((path_id(path, order) for path in paths), np.int64, len(rows)),
        "side": np.array(sides, dtype=np.int64),
        "mode": np.array(modes, dtype=object),
        "error": np.array(errors, dtype=object),
    }


def copy_samples(group: pa.Table, root_uri: str, image_column: str, label_column: str) -> pa.Table:
    """The rows of one source shard (its group) with each sample's bytes, read from the shard again:
    (target, row, id, encoded, label)."""
    from raytrain_common.images.decode import image_root

    root = image_root(root_uri)
    shard = group.column("shard")[0].as_py()
    wanted = {path: index for index, path in enumerate(group.column("path").to_pylist())}
    encoded: list[bytes | None] = [None] * group.num_rows
    try:
        for key, data, _, _ in samples_of(root, shard, image_column, label_column):
            index = wanted.get(f"{shard}#{key}")
            if index is not None:
                encoded[index] = data
    except SHARD_ERRORS:
        pass  # a truncated shard: the samples before its end were all prepare kept of it
    lost = [path for path, index in wanted.items() if encoded[index] is None]
    if lost:
        raise DataError(
            f"{join_uri(root.uri, lost[0])} is no longer in its shard ({len(lost)} samples "
            "changed since prepare checked them): run prepare again"
        )
    return pa.table(
        {
            "target": group.column("target"),
            "row": group.column("row"),
            "id": group.column("id"),
            "encoded": pa.array(encoded, pa.binary()),
            "label": group.column("label"),
        }
    )


def write_group(group: pa.Table) -> pa.Table:
    """One output shard (its group), its rows in order, written atomically: (target, bytes)."""
    import pyarrow.parquet as pq

    from raytrain_common.storage import resolve_storage, write_atomic

    target = group.column("target")[0].as_py()
    table = group.sort_by("row").select(["row", "id", "encoded", "label"])
    write_atomic(resolve_storage(target), functools.partial(pq.write_table, table))
    size = sum(len(data) for data in table.column("encoded").to_pylist())
    return pa.table({"target": [target], "bytes": pa.array([size], pa.int64())})


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def check_source(
    source: str, suffix: str, seed: int, max_bad_fraction: float, columns: tuple[str, str]
) -> CheckedTree:
    """Every shard read and every sample checked (Ray Data tasks, one per shard); refused as a tree
    is (tree_prep.check_tree), naming the shard and sample."""
    import ray.data

    from raytrain_common.ray_start import init_ray
    from raytrain_common.storage import resolve_storage

    root = resolve_storage(source)
    layout, shards = find_shards(root, suffix)
    if suffix == PARQUET:  # the columns, named before any task starts
        opened = root.join(*shards[0]["shard"].split("/"))
        with opened.filesystem.open_input_file(opened.path) as handle:
            next(parquet_samples(handle, *columns, opened.uri), None)
    init_ray(train_cpus=1)
    listed = (
        ray.data.from_items(shards, override_num_blocks=len(shards))
        .map_batches(
            scan_shard,
            batch_size=1,
            fn_kwargs={
                "root_uri": root.uri,
                "seed": seed,
                "image_column": columns[0],
                "label_column": columns[1],
            },
        )
        .materialize()
    )
    summary = summarise_checked(listed)
    refuse_unusable(root, summary, "samples in", "used")
    refuse_bad_share(root, listed, summary, max_bad_fraction)
    found = {
        split: [n for n, count in summary.count(split).items() if count] for split in layout.classes
    }
    layout = Layout(
        {split: dict.fromkeys(names, "") for split, names in found.items()}, layout.folder_names
    )
    classes = sorted(check_classes(root, layout, found), key=class_order(found))
    return CheckedTree(root, layout, listed, summary, classes)


def partitions(groups: int) -> int:
    """A shuffle's partitions: Ray Data's default (`DataContext.default_hash_shuffle_parallelism`,
    200), but never more than there are groups. A partition without a group is a task that does
    nothing: 200 of them for 20 source shards and 5 output shards took 13 s of a 3,500-image
    prepare on 2 cores."""
    from ray.data import DataContext

    return max(1, min(groups, DataContext.get_current().default_hash_shuffle_parallelism))


def class_order(found: dict[str, list[str]]) -> Any:
    """Classes named by integers (a .cls member, an int label column) in numeric order, so label
    2 stays label 2 where the classes are 0..n-1; any other names in text order."""
    names = {name for names in found.values() for name in names}
    if all(name.isdigit() for name in names):
        return int
    return str


class SourceShardWriter:
    """The driver's end of the copy: `submit` puts each output shard's rows (in order, with their
    target file) into Ray's object store; `finish` moves the bytes (copy_samples, write_group) and
    returns the bytes written."""

    def __init__(self, root_uri: str, columns: tuple[str, str]) -> None:
        self.root_uri, self.columns = root_uri, columns
        self.refs: list[Any] = []
        self.sources: set[str] = set()  # the source shards read: the driver lists them anyway

    def submit(self, rows: pa.Table, target: StoragePath) -> None:
        import ray

        paths = rows.column("path").to_pylist()
        shards = [path.rpartition("#")[0] for path in paths]
        self.sources.update(shards)
        self.refs.append(
            ray.put(
                rows.append_column("shard", pa.array(shards, pa.string())).append_column(
                    "target", pa.array([target.uri] * rows.num_rows, pa.string())
                )
            )
        )

    def finish(self) -> int:
        import ray.data

        if not self.refs:
            return 0
        written = (
            ray.data.from_arrow_refs(self.refs)
            .groupby("shard", num_partitions=partitions(len(self.sources)))
            .map_groups(
                copy_samples,
                batch_format="pyarrow",
                fn_kwargs={
                    "root_uri": self.root_uri,
                    "image_column": self.columns[0],
                    "label_column": self.columns[1],
                },
            )
            .groupby("target", num_partitions=partitions(len(self.refs)))
            .map_groups(write_group, batch_format="pyarrow")
        )
        total, files = 0, 0
        for batch in written.iter_batches(batch_size=1024, batch_format="numpy"):
            total += int(batch["bytes"].sum())
            files += len(batch["target"])
        if files != len(self.refs):
            raise DataError(f"wrote {files} shards, not the {len(self.refs)} planned")
        return total
