"""Memory and throughput of `prepare` and `train` as the dataset grows (`nox -s bench_data`).

VADER's human-rated sentences written as a CSV of 1×, 4× and 16× (by default) a base of 4,096 rows
(the sentences in a seeded order, repeated, each row marked with its copy so no two are equal),
prepared with `prepare --dataset` (a streamed CSV) and trained for a fixed number of steps on 2
CPU workers, each command a process of its own on a fresh local Ray cluster, as a user runs them.
Printed: the peak resident memory of the prepare process and of the largest training worker,
training rows/s (summary.json's `sentences_per_s`: over the progress windows after the first, so
neither start-up nor the validation pass at the stop, which grows with the split, counts), and the
ratios largest ÷ smallest.

    python -m benchmarks.hf_finetune.bench_data [--scales 1,4,16] [--base 4096] [--steps 100] [--folder DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from hf_finetune.data import download_vader, read_vader
from raytrain_testkit.scaling import ScalePoint, run_measured, scaling_table, write_labelled_csv

GLOBAL_BATCH = 32
LOG_EVERY = 10  # steps per progress window


def measure(
    scale: int, base: int, steps: int, sentences: list[tuple[str, str]], root: Path
) -> ScalePoint:
    source, data_dir = root / f"reviews-{scale}x.csv", root / f"data-{scale}x"
    write_labelled_csv(sentences, scale * base, source)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    prepare_mb, prepare_s = run_measured(
        "hf_finetune",
        ["prepare", "--dataset", str(source), "--data-dir", str(data_dir)],
        root / f"prepare-{scale}x.json",
        env,
    )
    run_measured(
        "hf_finetune",
        [
            "train",
            "--data-dir",
            str(data_dir),
            "--storage-path",
            str(root),
            "--run-name",
            f"bench-{scale}x",
            "--epochs",
            "1",
            "--stop-at-step",
            str(steps),
            "--global-batch-size",
            str(GLOBAL_BATCH),
            "--log-every-steps",
            str(LOG_EVERY),
            "--tracking",
            "none",
        ],
        root / f"train-{scale}x.json",
        env,
    )
    summary = json.loads((root / f"bench-{scale}x" / "summary.json").read_text())
    return ScalePoint(
        scale=scale,
        items=summary["dataset"]["rows"]["train"],
        prepare_peak_mb=prepare_mb,
        prepare_s=prepare_s,
        worker_peak_mb=summary["worker_peak_rss_mb"],
        items_per_s=summary["sentences_per_s"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="1,4,16", help="multiples of the base")
    parser.add_argument("--base", type=int, default=4096, help="rows of the CSV at 1×")
    # 100 steps: 4 length-sorted mega-batches (25 steps each on 2 workers), whose long rows first
    # and short ones last make a 10-step window's rate swing ±25 %.
    parser.add_argument("--steps", type=int, default=100, help="training steps per size")
    parser.add_argument("--folder", help="where the datasets and runs go (default: a temp folder)")
    args = parser.parse_args(argv)
    scales = sorted(int(s) for s in args.scales.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-data-hf-") as temporary:
        root = Path(args.folder or temporary)
        root.mkdir(parents=True, exist_ok=True)
        vader = read_vader(download_vader(root / "download"))
        sentences = list(zip(vader["text"].to_pylist(), vader["label"].to_pylist(), strict=True))
        points = [measure(scale, args.base, args.steps, sentences, root) for scale in scales]
    print(scaling_table("hf_finetune", "rows", points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
