"""`prepare --force` is safe in every pipeline: one rule (`raytrain_common.storage.staged_output`)
decides what a command may replace and when the new output takes the old one's place.

On object storage (an S3 protocol server on loopback, in its own process) a rewrite that fails at
its worst moment, every new file written and the marker not yet, leaves the old dataset usable as
it was: the marker still names the old files, which a training run's checks and readers find.
A rewrite that completes replaces it and deletes the old files. Locally the same is a rename.
Another pipeline's data folder is refused by each (tests/test_bad_input.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
from PIL import Image

import hf_finetune.cli
import llm_fsdp.cli
import mnist_resnet.cli
from raytrain_common.images.dataset import inspect_dataset as inspect_images
from raytrain_common.images.dataset import split_folder
from raytrain_common.labelled.prepare import inspect_dataset as inspect_labelled
from raytrain_common.labelled.prepare import read_labels
from raytrain_common.storage import StagedOutput, StoragePath, join_uri, resolve_storage
from raytrain_common.tokens.corpus import inspect_dataset as inspect_tokens
from raytrain_common.tokens.corpus import split_blocks

pytestmark = pytest.mark.ray  # prepare's Ray Data jobs, on the process's cluster


def image_tree(root: Path, side: int) -> Path:
    """Three classes of 16 images each, a colour and a gradient apiece."""
    rng = np.random.default_rng(side)
    for label, colour in enumerate(("red", "green", "blue")):
        for i in range(16):
            pixels = np.zeros((side, side, 3), np.uint8)
            pixels[..., label] = rng.integers(96, 255)
            pixels[: side // 2, :, (label + 1) % 3] = 8 * i
            path = root / colour / f"{i:02d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(path)
    return root


def reviews(path: Path, rows: int) -> Path:
    lines = ["text,label"] + [
        f"review {i}: {'a warm and lovely' if i % 2 else 'a dull and tiresome'} film,"
        f"{'pos' if i % 2 else 'neg'}"
        for i in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def fail_at_the_swap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker's one write, the moment a rewrite replaces the old output, fails: every new
    file is written by then, so this is the failure that finds an old file overwritten."""

    def dropped(self: StagedOutput, record: dict[str, object]) -> None:
        raise OSError("injected: the connection to the object store dropped")

    monkeypatch.setattr(StagedOutput, "write_marker", dropped)


def objects(folder: StoragePath) -> dict[str, int]:
    selector = pafs.FileSelector(folder.path, recursive=True, allow_not_found=True)
    return {
        info.path: info.size
        for info in folder.filesystem.get_file_info(selector)
        if info.type == pafs.FileType.File
    }


Rewrites = Callable[[Callable[..., int], Callable[[StoragePath], object], StoragePath], tuple]


@pytest.fixture
def forced_rewrites(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Rewrites:
    return functools.partial(rewritten, monkeypatch=monkeypatch, capsys=capsys)


def rewritten(
    prepare: Callable[..., int],
    usable: Callable[[StoragePath], object],
    data_dir: StoragePath,
    *,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[object, object]:
    """Prepared once, forced with a failure at the swap (the old dataset, its every object, still
    there and read as before), forced again to completion: what `usable` read before and after."""
    assert prepare() == 0
    before, held = usable(data_dir), objects(data_dir)
    with monkeypatch.context() as patch:
        fail_at_the_swap(patch)
        with pytest.raises(OSError, match="injected"):
            prepare("--force")
    assert usable(data_dir) == before
    assert objects(data_dir) == held  # the failed rewrite's own files gone, nothing of the old
    capsys.readouterr()
    assert prepare("--force") == 0
    after = usable(data_dir)
    if not data_dir.is_local:  # the old generation's objects deleted once the new one is named
        assert not set(objects(data_dir)) & set(held) - {data_dir.join("dataset.json").path}
    return before, after


def test_mnist_prepare_force_on_s3_keeps_the_old_dataset_until_the_new_one_is_whole(
    ray_cluster: None, s3_prefix: str, tmp_path: Path, forced_rewrites: Rewrites
) -> None:
    tree = image_tree(tmp_path / "shapes", side=20)
    data_dir = resolve_storage(join_uri(s3_prefix, "images"))
    sizes = iter(("12", "16"))

    def prepare(*force: str) -> int:
        argv = ["prepare", "--source", str(tree), "--data-dir", data_dir.uri, *force]
        return mnist_resnet.cli.main([*argv, "--image-size", next(sizes) if force else "12"])

    def usable(folder: StoragePath) -> tuple[int, list[str]]:
        info = inspect_images(folder, "mnist-resnet prepare")  # every footer and row count
        split = split_folder(folder, "train", info.files_in)
        return info.height, sorted(file.path for file in split.list_files(".parquet"))

    before, after = forced_rewrites(prepare, usable, data_dir)
    assert before[0] == 12 and after[0] == 16  # type: ignore[index]


def test_hf_prepare_force_on_s3_keeps_the_old_dataset_and_repairs_a_damaged_one(
    ray_cluster: None, s3_prefix: str, tmp_path: Path, forced_rewrites: Rewrites
) -> None:
    source = reviews(tmp_path / "reviews.csv", rows=60)
    data_dir = resolve_storage(join_uri(s3_prefix, "reviews"))
    lengths = iter(("32", "48"))

    def prepare(*force: str) -> int:
        argv = ["prepare", "--dataset", str(source), "--data-dir", data_dir.uri, *force]
        return hf_finetune.cli.main([*argv, "--max-length", next(lengths) if force else "32"])

    def usable(folder: StoragePath) -> tuple[int, list[int]]:
        info = inspect_labelled(folder, "hf-finetune prepare")  # every split's rows
        return info.max_length, read_labels(folder, "train").tolist()

    before, after = forced_rewrites(prepare, usable, data_dir)
    assert before[0] == 32 and after[0] == 48  # type: ignore[index]
    assert sorted(before[1]) == sorted(after[1])  # type: ignore[index]

    # A split cut off behind the marker's back: training refuses it, --force writes it anew.
    marker = json.loads(data_dir.join("dataset.json").read_text())
    train = resolve_storage(join_uri(data_dir.uri, marker["files_in"], "train"))
    train.filesystem.delete_dir(train.path)
    with pytest.raises(ValueError, match=r"rerun `hf-finetune prepare --force`"):
        usable(data_dir)
    lengths = iter(("48",))
    assert prepare("--force") == 0
    assert usable(data_dir) == after


def test_llm_prepare_force_keeps_the_old_dataset_when_it_fails(
    ray_cluster: None, tmp_path: Path, forced_rewrites: Rewrites, capsys: pytest.CaptureFixture[str]
) -> None:
    """Locally the new dataset is written beside the old and renamed into place: a failure
    leaves the old one and no half-written folder. (Its prepare writes local or mounted folders
    only, the tokenizer among them; object storage is refused before any work.)"""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        lines = [
            f"Line {j} of play {i}: the king speaks, and the fool answers him." for j in range(40)
        ]
        (corpus / f"play-{i:02d}.txt").write_text("\n".join(lines))
    data_dir = resolve_storage(tmp_path / "tokens")
    lengths = iter(("16", "24"))

    def prepare(*force: str) -> int:
        argv = ["prepare", "--dataset", str(corpus), "--tokenizer", "bpe:300", *force]
        length = next(lengths) if force else "16"
        return llm_fsdp.cli.main([*argv, "--data-dir", data_dir.uri, "--seq-len", length])

    def usable(folder: StoragePath) -> tuple[int, int]:
        info = inspect_tokens(folder, "llm-fsdp prepare")
        return info.seq_len, len(split_blocks(folder, "train", info))

    before, after = forced_rewrites(prepare, usable, data_dir)
    assert before[0] == 16 and after[0] == 24  # type: ignore[index]
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    bucket = "s3://bucket/tokens?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1"
    s3 = llm_fsdp.cli.main(["prepare", "--data-dir", bucket, "--force"])
    assert s3 == 2
    assert "give a local or NFS --data-dir" in capsys.readouterr().err
