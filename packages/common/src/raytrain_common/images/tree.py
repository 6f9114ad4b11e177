"""`prepare` of a class-per-folder image tree (local, NFS, s3://, gs://; layouts in
`images.files`), streamed: nothing in the driver grows with the number of files.

- The driver lists only the tree's top folders: its splits and class folders (at most
  MAX_CLASSES each).
- Ray Data tasks list every class folder, a page of LIST_PAGE files at a time (`list_folders`),
  then read and decode each file once (`decode.check_files`, a page a task, 16 fetched at
  once). The checked list is materialised in Ray's object store (spilled to disk past
  it), ~150 bytes a file: 15 GB at 100 M files, spread over the cluster.
- Each block of that list is summed into a few counters (`summarise`: files per class, modes,
  shorter sides, files left out); the driver adds up one small record per block.
- Ray Data sorts the good files by a seeded hash of each path (`order_key`: a uniform random
  order; training's cheap fresh order every epoch relies on each file being a uniform sample,
  see `images.stream`). The driver streams them in that order (`SplitWriter`): each class's first
  rows, as many as the stratified carve holds out, go to the test split, the next to validation,
  the rest to training, each split into Parquet files of ROWS_PER_FILE rows, numbered. It holds
  one file's rows and a counter per class. Held out are thus each class's files with the smallest
  hashes: a file added to or removed from the tree moves at most one other file of its class
  across the line.

Not Ray Data's own file listing (`ListFiles` in Ray 2.60): it lists each folder it is given in one
task that returns the whole folder, drops other files without counting them, and cannot say which
name is not UTF-8; here a class folder streams out page by page.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import posixpath
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_common.images import files as image_files
from raytrain_common.images.dataset import DataError
from raytrain_common.storage import StoragePath, join_uri

log = logging.getLogger(__name__)

# Files of a class folder listed into one block, and checked by one Ray Data task: the driver
# holds Ray Data's reference to each block (a few hundred bytes), ~10 MB at 100 M files.
LIST_PAGE = 4096
IMAGE, OTHER, BAD_NAME = "image", "other", "bad-name"  # a listed file's kind
ORDER_KEY = b"row-order"  # with the seed: the hash the rows of a split are ordered by
MAX_CLASSES = 1000  # class folders a tree may have (and the largest label + 1 of an IDX source)
SHARD_ROWS = 1_000  # images a shard holds (prepare --shards): ~100 MB of ImageNet's JPEGs
STATS_SAMPLE = 2048  # training images decoded for the mean and std (±0.5 % of the full split's)


def path_id(relative: str, key: bytes = b"") -> int:
    """A file's id: 63 bits of a hash of its path relative to the tree, so a file keeps its id
    when others are added or removed and the tree is prepared again (1.28 M files share an id
    with probability ~1e-7). With `key`, a seeded draw per file (the carve's and the order's)."""
    digest = hashlib.blake2b(relative.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "big") >> 1


def seed_key(seed: int, purpose: bytes = b"") -> bytes:
    return purpose + seed.to_bytes(8, "big", signed=True)


# ---------------------------------------------------------------------------------------------
# The layout: the driver lists the top folders only
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where a tree's splits and classes are: split → {class name: folder relative to the tree}
    ("all" when the tree has no train/ and test/ folders), and each split's folder name."""

    classes: dict[str, dict[str, str]]
    folder_names: dict[str, str] = field(default_factory=dict)


def entries(folder: StoragePath) -> tuple[list[str], list[str]]:
    """(folders, files) directly in `folder`, sorted, hidden ones left out; folder names checked
    for UTF-8 (images.utf8_name)."""
    if folder.is_local:
        with os.scandir(folder.path) as found:
            items = [(item.name, item.is_dir()) for item in found]
    else:
        selector = pafs.FileSelector(folder.path, allow_not_found=True)
        items = [
            (info.base_name, info.type == pafs.FileType.Directory)
            for info in folder.filesystem.get_file_info(selector)
        ]
    visible = sorted(item for item in items if not item[0].startswith("."))
    folders = [image_files.utf8_name(name) for name, is_dir in visible if is_dir]
    return folders, [name for name, is_dir in visible if not is_dir]


def split_folders(root: StoragePath) -> dict[str, str]:
    """The source's splits → their folder: train/ and test/ (val/ too) when it has them, any case,
    else {"all": ""} (the whole source, carved)."""
    top, _ = entries(root)
    by_lower = {name.lower(): name for name in sorted(top, reverse=True)}
    test_name = next((name for name in image_files.TEST_FOLDERS if name in by_lower), None)
    val_name = next((n for n in image_files.VAL_FOLDERS if n in by_lower and n != test_name), None)
    if "train" not in by_lower or not test_name:
        return {"all": ""}
    roots = {"train": by_lower["train"], "test": by_lower[test_name]}
    if val_name:
        roots["val"] = by_lower[val_name]
    return roots


def find_layout(root: StoragePath) -> Layout:
    """The tree's splits and class folders, from its top two levels; an error naming the folder
    when images lie loose where class folders belong."""
    roots = split_folders(root)
    classes = {}
    for split, prefix in roots.items():
        where = root.join(prefix) if prefix else root
        folders, files = entries(where)
        loose = sum(
            posixpath.splitext(name)[1].lower() in image_files.IMAGE_SUFFIXES for name in files
        )
        if loose and not folders:
            raise DataError(
                f"{where} holds {loose} images but no class folders: put each class's images "
                f"in a folder named after the class ({where}/<class>/image.png)"
            )
        classes[split] = {name: posixpath.join(prefix, name) for name in folders}
    return Layout(classes, {split: prefix for split, prefix in roots.items()})


# ---------------------------------------------------------------------------------------------
# Ray Data tasks: list, check, sum up, carve
# ---------------------------------------------------------------------------------------------


def walk(root: StoragePath, folder: str) -> Iterator[str]:
    """The files under `folder` (relative to `root`) at any depth, as paths relative to `root`;
    hidden files and folders left out. A local folder streams (os.walk); an object store's prefix
    comes from one recursive listing (pyarrow's, paged by the store: ~200 bytes a file of the
    class folder in this task, freed as the pages are yielded)."""
    if not root.is_local:
        selector = pafs.FileSelector(root.join(folder).path, allow_not_found=True, recursive=True)
        for info in root.filesystem.get_file_info(selector):
            relative = posixpath.relpath(info.path, root.path)
            hidden = any(part.startswith(".") for part in relative.split("/"))
            if info.type == pafs.FileType.File and not hidden:
                yield relative
        return
    base = root.path
    for current, folders, files in os.walk(posixpath.join(base, folder)):
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                yield posixpath.relpath(posixpath.join(current, name), base)


def list_folders(
    batch: dict[str, np.ndarray], root_uri: str, seed: int
) -> Iterator[dict[str, np.ndarray]]:
    """Class folders → their files, LIST_PAGE to a block: (split, class_name, path, kind, id, and
    the seeded hash the carves and the row order use)."""
    from raytrain_common.images.decode import image_root

    root = image_root(root_uri)
    for split, name, folder in zip(
        batch["split"], batch["class_name"], batch["folder"], strict=True
    ):
        page: list[str] = []
        for relative in walk(root, str(folder)):
            page.append(relative)
            if len(page) == LIST_PAGE:
                yield listed_page(page, str(split), str(name), seed)
                page = []
        if page:
            yield listed_page(page, str(split), str(name), seed)


def listed_page(paths: list[str], split: str, class_name: str, seed: int) -> dict[str, np.ndarray]:
    kinds, names = [], []
    for path in paths:
        try:
            image_files.utf8_name(path)
        except image_files.ImageFolderError as error:
            kinds.append(BAD_NAME)
            names.append(str(error))
            continue
        suffix = posixpath.splitext(path)[1].lower()
        kinds.append(IMAGE if suffix in image_files.IMAGE_SUFFIXES else OTHER)
        names.append(path)
    usable = [name if kind != BAD_NAME else "" for name, kind in zip(names, kinds, strict=True)]
    columns: dict[str, np.ndarray] = {
        "split": np.full(len(paths), split, dtype=object),
        "class_name": np.full(len(paths), class_name, dtype=object),
        "path": np.array(names, dtype=object),
        "kind": np.array(kinds, dtype=object),
        "id": np.fromiter((path_id(name) for name in usable), np.int64, len(paths)),
    }
    order = seed_key(seed, ORDER_KEY)
    columns["order_key"] = np.fromiter((path_id(n, order) for n in usable), np.int64, len(paths))
    return columns


def summarise(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One block of the checked list → one row of counters (JSON): good images per split and
    class, other files by suffix, files left out (and the first), modes, shorter sides."""
    kinds, errors = batch["kind"], batch["error"]
    good = (kinds == IMAGE) & (errors == "")
    bad = (kinds == IMAGE) & (errors != "")
    pairs = Counter(
        f"{split}/{name}"
        for split, name in zip(batch["split"][good], batch["class_name"][good], strict=True)
    )
    others = Counter(
        posixpath.splitext(str(path))[1].lower() or "(none)"
        for path in batch["path"][kinds == OTHER]
    )
    sides, counts = np.unique(batch["side"][good], return_counts=True)
    record = {
        "classes": dict(pairs),
        "skipped": dict(others),
        "bad": int(bad.sum()),
        "first_bad": [str(batch["path"][bad][0]), str(errors[bad][0])] if bad.any() else None,
        "bad_name": next((str(p) for p in batch["path"][kinds == BAD_NAME]), None),
        "modes": dict(Counter(str(mode) for mode in batch["mode"][good])),
        "sides": [[int(s), int(c)] for s, c in zip(sides, counts, strict=True)],
    }
    return {"summary": np.array([json.dumps(record)], dtype=object)}


# ---------------------------------------------------------------------------------------------
# The driver: plans from counters, writes from a sorted stream
# ---------------------------------------------------------------------------------------------


@dataclass
class TreeSummary:
    """What the checked list holds, added up over its blocks."""

    classes: Counter[str] = field(default_factory=Counter)  # "split/class" → good images
    skipped: Counter[str] = field(default_factory=Counter)
    bad: int = 0
    first_bad: tuple[str, str] | None = None
    bad_name: str | None = None
    modes: Counter[str] = field(default_factory=Counter)
    sides: Counter[int] = field(default_factory=Counter)

    def add(self, record: dict[str, Any]) -> None:
        self.classes.update(record["classes"])
        self.skipped.update(record["skipped"])
        self.bad += record["bad"]
        self.first_bad = self.first_bad or (
            tuple(record["first_bad"]) if record["first_bad"] else None
        )
        self.bad_name = self.bad_name or record["bad_name"]
        self.modes.update(record["modes"])
        self.sides.update({side: count for side, count in record["sides"]})

    def count(self, split: str) -> dict[str, int]:
        """Good images per class name in one split of the tree."""
        return {
            key.split("/", 1)[1]: count
            for key, count in sorted(self.classes.items())
            if key.split("/", 1)[0] == split
        }

    @property
    def checked(self) -> int:
        return sum(self.classes.values()) + self.bad

    def median_side(self) -> float:
        """The median shorter side of the good images, from their counts."""
        total = sum(self.sides.values())
        ordered = sorted(self.sides.items())
        middle = []
        for target in sorted({(total - 1) // 2, total // 2}):
            seen = 0
            for side, count in ordered:
                seen += count
                if seen > target:
                    middle.append(side)
                    break
        return float(np.mean(middle))


def held_out_counts(counts: dict[str, int], fraction: float) -> dict[str, int]:
    """Per class, how many rows a stratified carve of `fraction` holds out (images.held_out_rows
    for the whole, shared in proportion; each class keeps a row to train on)."""
    total = sum(counts.values())
    if total == 0:
        return {name: 0 for name in counts}
    target = image_files.held_out_rows(total, fraction)
    return {
        name: min(count - 1, max(1, round(target * count / total)))
        for name, count in counts.items()
    }


class SplitWriter:
    """The good files in `order_key` order → each class's first `held_out` [test, validation]
    rows to those splits, the rest to training (a test/ or val/ folder's rows stay there), every
    split into part files of `rows_per_file` rows, numbered (`row`) in the order they come. The
    fingerprint digests them in that order, and the first `sample` training rows (a seeded
    uniform draw: the order is) are kept for the pixel statistics."""

    def __init__(
        self,
        write_part: Callable[[str, int, pa.Table], None],
        carve: Carve,
        labels: dict[str, int],
        rows_per_file: int,
        sample: int = STATS_SAMPLE,
    ) -> None:
        self.write_part, self.rows_per_file, self.sample = write_part, rows_per_file, sample
        self.quota = {key: list(counts) for key, counts in carve.held_out.items()}
        self.labels = labels
        self.rows: Counter[str] = Counter()
        self.parts: Counter[str] = Counter()
        self.pending: dict[str, list[pa.Table]] = {}
        self.digest = hashlib.blake2b(digest_size=8)
        self.sampled: list[pa.Table] = []

    def assign(self, sources: np.ndarray, names: np.ndarray) -> np.ndarray:
        """Each row's split, in order: its class's test quota first, then validation's."""
        final = np.where(np.isin(sources, ("all", "train")), "train", sources).astype(object)
        groups = np.char.add(np.char.add(sources.astype(str), "/"), names.astype(str))
        for key in np.unique(groups):
            quota = self.quota.get(str(key))
            if not quota or not any(quota):
                continue
            members = np.flatnonzero(groups == key)
            test, val = min(quota[0], len(members)), 0
            val = min(quota[1], len(members) - test)
            final[members[:test]] = "test"
            final[members[test : test + val]] = "val"
            quota[0] -= test
            quota[1] -= val
        return final

    def add(self, batch: dict[str, np.ndarray]) -> None:
        final = self.assign(batch["split"], batch["class_name"])
        labels = np.array([self.labels[str(name)] for name in batch["class_name"]], np.int64)
        for split in sorted(set(final)):
            chosen = final == split
            start = self.rows[split]
            table = pa.table(
                {
                    "row": pa.array(np.arange(start, start + int(chosen.sum())), pa.int64()),
                    "id": pa.array(batch["id"][chosen], pa.int64()),
                    "path": pa.array(list(batch["path"][chosen]), pa.string()),
                    "label": pa.array(labels[chosen], pa.int64()),
                }
            )
            self.rows[split] += table.num_rows
            self.digest.update(split.encode())
            self.digest.update(np.ascontiguousarray(batch["id"][chosen], np.int64).tobytes())
            self.digest.update(labels[chosen].tobytes())
            if split == "train" and sum(t.num_rows for t in self.sampled) < self.sample:
                self.sampled.append(table.slice(0, self.sample))
            self.pending.setdefault(split, []).append(table)
            self.flush(split, final=False)

    def flush(self, split: str, final: bool) -> None:
        held = pa.concat_tables(self.pending.get(split, [])) if self.pending.get(split) else None
        while held is not None and (
            held.num_rows >= self.rows_per_file or (final and held.num_rows > 0)
        ):
            self.write_part(split, self.parts[split], held.slice(0, self.rows_per_file))
            self.parts[split] += 1
            held = held.slice(self.rows_per_file)
        self.pending[split] = [held] if held is not None and held.num_rows else []

    def close(self) -> None:
        for split in list(self.pending):
            self.flush(split, final=True)

    def stats_sample(self) -> pa.Table:
        return pa.concat_tables(self.sampled).slice(0, self.sample)


def failed_files(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    failed = (batch["kind"] == IMAGE) & (batch["error"] != "")
    return {"path": batch["path"][failed], "error": batch["error"][failed]}


def bad_files_rows(listed: Any, root_uri: str, count: int) -> Iterator[tuple[str, str]]:
    """(file, why) of every file left out (`count` of them), streamed from the checked list."""
    if not count:
        return
    failed = listed.map_batches(failed_files, batch_size=4096)
    for batch in failed.iter_batches(batch_size=4096, batch_format="numpy"):
        for path, why in zip(batch["path"], batch["error"], strict=True):
            yield join_uri(root_uri, str(path)), str(why)


def bad_files_csv(rows: Iterator[tuple[str, str]]) -> Callable[[Any], None]:
    """A writer of bad_files.csv (`file,reason`) from a stream of rows, a chunk at a time."""

    def write(stream: Any) -> None:
        text = io.StringIO()
        writer = csv.writer(text)
        writer.writerow(["file", "reason"])
        for index, row in enumerate(rows, 1):
            writer.writerow(row)
            if index % 4096 == 0:
                stream.write(text.getvalue().encode("utf-8"))
                text.seek(0)
                text.truncate()
        stream.write(text.getvalue().encode("utf-8"))

    return write


# ---------------------------------------------------------------------------------------------
# prepare, for a tree
# ---------------------------------------------------------------------------------------------


def check_classes(root: StoragePath, layout: Layout, found: dict[str, list[str]]) -> list[str]:
    """The training classes (sorted) of a tree whose splits hold the classes `found` (folders
    before the listing, folders with good images after it); an error naming the folder when
    there are fewer than two, or a held-out split has a class training lacks."""
    train_split = "train" if "train" in layout.classes else "all"
    classes = sorted(found.get(train_split, []))
    where = root.join(layout.folder_names[train_split]) if train_split == "train" else root
    if len(classes) > MAX_CLASSES:
        raise DataError(
            f"{where} has {len(classes)} class folders, over the {MAX_CLASSES} this pipeline "
            "trains: is --source the folder above the class folders?"
        )
    if len(classes) < 2:
        what = f"one class ({classes[0]!r})" if classes else "no class folder with images"
        raise DataError(
            f"{where} has {what}: a classifier needs at least two class folders, each holding "
            f"images ({', '.join(image_files.IMAGE_SUFFIXES)})"
        )
    for held_out in ("test", "val"):
        unknown = sorted(set(found.get(held_out, [])) - set(classes))
        if unknown:
            raise DataError(
                f"{root.join(layout.folder_names[held_out])} has classes {unknown} that {where} "
                f"lacks: the {held_out} classes must be among the training ones"
            )
    return classes


@dataclass
class CheckedTree:
    """A tree listed and checked: the list in Ray's object store, its counters, its classes."""

    root: StoragePath
    layout: Layout
    listed: Any  # ray.data.MaterializedDataset of the listed files, checked
    summary: TreeSummary
    class_names: list[str]


def check_tree(source: str, seed: int, max_bad_fraction: float) -> CheckedTree:
    """List and check every file of the tree (Ray Data tasks), and refuse a tree this pipeline
    cannot train on, naming the folder or file: a name that is not UTF-8, no decodable image,
    more than `max_bad_fraction` of its images undecodable (`refuse_bad_share`), fewer than two
    classes with good images, a held-out class training lacks."""
    import ray.data

    from raytrain_common.images.decode import check_files
    from raytrain_common.ray_start import init_ray
    from raytrain_common.storage import resolve_storage

    root = resolve_storage(source)
    try:
        layout = find_layout(root)
    except image_files.ImageFolderError as error:
        raise DataError(str(error)) from error
    folders = [
        {"split": split, "class_name": name, "folder": folder}
        for split, classes in layout.classes.items()
        for name, folder in classes.items()
    ]
    # Refused by its folders before any file is listed; by its images again after.
    check_classes(root, layout, {split: list(names) for split, names in layout.classes.items()})
    init_ray(train_cpus=1)  # only now: the checks before run without a cluster
    listed = (
        ray.data.from_items(folders, override_num_blocks=len(folders))
        .map_batches(list_folders, batch_size=1, fn_kwargs={"root_uri": root.uri, "seed": seed})
        .map_batches(check_files, batch_size=LIST_PAGE, fn_kwargs={"root_uri": root.uri})
        .materialize()
    )
    summary = summarise_checked(listed)
    if summary.bad_name:
        raise DataError(summary.bad_name)
    refuse_unusable(root, summary, "images under", "decoded")
    refuse_bad_share(root, listed, summary, max_bad_fraction)
    found = {
        split: [n for n, count in summary.count(split).items() if count] for split in layout.classes
    }
    train_classes = check_classes(root, layout, found)
    return CheckedTree(root, layout, listed, summary, train_classes)


def summarise_checked(listed: Any) -> TreeSummary:
    """The checked list's counters: one record per block (`summarise`), added up here."""
    summary = TreeSummary()
    counters = listed.map_batches(summarise, batch_size=None)
    for batch in counters.iter_batches(batch_size=256, batch_format="numpy"):
        for record in batch["summary"]:
            summary.add(json.loads(record))
    return summary


def refuse_unusable(root: StoragePath, summary: TreeSummary, what: str, failed: str) -> None:
    """Refuse a source of which not one image can be used, naming the first failure."""
    if summary.checked and not summary.classes:
        first, why = summary.first_bad or ("?", "?")
        raise DataError(
            f"none of the {summary.checked} {what} {root} can be {failed} (first: "
            f"{join_uri(root.uri, first)}: {why}): is --source the right folder?"
        )


def refuse_bad_share(
    root: StoragePath, listed: Any, summary: TreeSummary, max_bad_fraction: float
) -> None:
    """Refuse a tree whose share of undecodable files is above `max_bad_fraction` (more likely a
    wrong folder or a broken copy than a few bad files); the list goes to a temporary CSV, since
    nothing is written to --data-dir by a refused prepare."""
    import tempfile

    bad, checked = summary.bad, max(summary.checked, 1)
    if bad / checked <= max_bad_fraction:
        return
    with tempfile.NamedTemporaryFile("wb", prefix="bad_files-", suffix=".csv", delete=False) as out:
        bad_files_csv(bad_files_rows(listed, root.uri, bad))(out)
    first, why = summary.first_bad or ("?", "?")
    raise DataError(
        f"{bad} of {checked} files ({bad / checked:.1%}) cannot be decoded, over "
        f"--max-bad-fraction {max_bad_fraction:g} (first: {join_uri(root.uri, first)}: "
        f"{why}; all: {out.name}): check that --source is the right folder, or raise "
        "--max-bad-fraction to leave them out"
    )


@dataclass(frozen=True)
class Carve:
    """How many rows of each split-and-class group the carves hold out ([test, validation]),
    the resulting split sizes, and what dataset.json says of them."""

    held_out: dict[str, list[int]]
    sizes: dict[str, int]
    notes: dict[str, str]


def plan_carve(tree: CheckedTree, test_fraction: float, val_fraction: float, seed: int) -> Carve:
    summary, layout = tree.summary, tree.layout
    held_out: dict[str, list[int]] = {}
    notes: dict[str, str] = {}
    if "all" in layout.classes:
        counts = summary.count("all")
        tests = held_out_counts(counts, test_fraction)
        kept = {name: counts[name] - tests[name] for name in counts}
        vals = held_out_counts(kept, val_fraction)
        held_out = {f"all/{name}": [tests[name], vals[name]] for name in counts}
        sizes = {"test": sum(tests.values()), "val": sum(vals.values())}
        notes["test_split"] = f"carved: {sizes['test']} images, stratified by class, seed {seed}"
        log.info("no train/ and test/ folders: %s", notes["test_split"])
        sizes["train"] = sum(counts.values()) - sizes["test"] - sizes["val"]
    else:
        counts = summary.count("train")
        sizes = {"test": sum(summary.count("test").values())}
        notes["test_split"] = f"the source's own {layout.folder_names['test']}/ folder"
        if "val" in layout.classes:
            sizes["val"] = sum(summary.count("val").values())
            notes["val_split"] = f"the source's own {layout.folder_names['val']}/ folder"
        else:
            vals = held_out_counts(counts, val_fraction)
            held_out = {f"train/{name}": [0, vals[name]] for name in counts}
            sizes["val"] = sum(vals.values())
        sizes["train"] = sum(counts.values()) - (0 if "val" in layout.classes else sizes["val"])
    if "val_split" not in notes:
        notes["val_split"] = (
            f"carved from the training data: {sizes['val']} images, stratified by class, "
            f"seed {seed + 1}"
        )
    if sizes["val"] == 0:
        raise DataError(
            f"the training data has {sizes['train']} images: too few to hold out a "
            "validation split (each class keeps at least one image to train on); give more "
            "images per class, or a val/ folder beside train/ and test/"
        )
    if sizes["test"] == 0:
        raise DataError("test split is empty")
    return Carve(held_out, sizes, notes)


def keep_good(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    keep = (batch["kind"] == IMAGE) & (batch["error"] == "")
    return {name: batch[name][keep] for name in ("split", "class_name", "path", "id", "order_key")}


def write_tree_splits(
    tree: CheckedTree,
    carve: Carve,
    write_part: Callable[[str, int, pa.Table], None],
    rows_per_file: int,
) -> SplitWriter:
    """The good files sorted by their seeded hash (Ray Data's sort), carved and written from the
    sorted stream (SplitWriter, returned: it holds the fingerprint's digest and the statistics'
    sample)."""
    labels = {name: index for index, name in enumerate(tree.class_names)}
    writer = SplitWriter(write_part, carve, labels, rows_per_file)
    ordered = tree.listed.map_batches(keep_good, batch_size=4096).sort("order_key")
    for batch in ordered.iter_batches(batch_size=rows_per_file, batch_format="numpy"):
        writer.add(batch)
    writer.close()
    return writer


def tree_fingerprint(source: str, side: int, channels: int, writer: SplitWriter) -> str:
    """What the prepared rows are, in 16 hex digits: the source, the size, and every split's
    (id, label) pairs in row order (so data prepared with another row order differs too)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps([source, side, channels, "rows by seeded path hash"]).encode())
    digest.update(writer.digest.digest())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# prepare --shards: the files copied, encoded as they are, into the splits' Parquet files
# ---------------------------------------------------------------------------------------------


def write_shard(rows: pa.Table, root_uri: str, target_uri: str) -> int:
    """One shard, in a Ray task: its rows' files fetched (16 at once) and written with their bytes
    as they are (no decoding: a JPEG stays a JPEG), beside row, id and label; its bytes."""
    import functools

    import pyarrow.parquet as pq

    from raytrain_common.images.decode import fetch, image_root
    from raytrain_common.storage import resolve_storage, write_atomic

    root = image_root(root_uri)
    paths = rows.column("path").to_pylist()
    encoded = []
    for path, stream in zip(paths, fetch(root, paths), strict=True):
        if isinstance(stream, OSError):
            raise DataError(
                f"{join_uri(root.uri, path)} cannot be read for its shard ({stream}): it "
                "changed since prepare checked it; run prepare again"
            )
        encoded.append(stream.getvalue())
    table = pa.table(
        {
            "row": rows.column("row"),
            "id": rows.column("id"),
            "encoded": pa.array(encoded, pa.binary()),
            "label": rows.column("label"),
        }
    )
    write_atomic(resolve_storage(target_uri), functools.partial(pq.write_table, table))
    return sum(len(data) for data in encoded)


class ShardWriter:
    """Submits `write_shard` as Ray tasks spread over the cluster, at most two per CPU at once (the
    driver holds their references and one shard's rows each, whatever the tree's size)."""

    def __init__(self, root_uri: str) -> None:
        import ray

        self.root_uri = root_uri
        self.task = ray.remote(write_shard)
        self.limit = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        self.pending: list[Any] = []
        self.bytes = 0

    def submit(self, rows: pa.Table, target: StoragePath) -> None:
        import ray

        while len(self.pending) >= self.limit:
            done, self.pending = ray.wait(self.pending, num_returns=1)
            self.bytes += sum(ray.get(done))
        self.pending.append(self.task.remote(rows, self.root_uri, target.uri))

    def finish(self) -> int:
        """Waits for every shard; the bytes written."""
        import ray

        self.bytes += sum(ray.get(self.pending))
        self.pending = []
        return self.bytes
