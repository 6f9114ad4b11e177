"""Data-scaling benchmarks: does a pipeline's memory stay flat as its dataset grows?

Each pipeline's `bench_data` module builds its dataset at several multiples of a base size, runs its
own `prepare` and `train` commands on each as a user would, and hands the figures to
`scaling_table`, which prints them with the ratios that answer the question: the peak resident
memory of the `prepare` process and of the largest training worker at the largest size ÷ at the
smallest, a worker's growth in bytes per item of data (token, image, sentence), and the training
throughput at the largest size ÷ at the smallest.

`python -m raytrain_testkit.scaling OUT -m MODULE ARGS…` runs `python -m MODULE ARGS…` in this
process and writes its peak resident memory to OUT (JSON) when it ends: the measure of a command's
own memory, without the Ray processes it starts (those are measured inside the workers:
summary.json's `worker_peak_rss_mb`).
"""

from __future__ import annotations

import csv
import json
import runpy
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raytrain_common.hardware import peak_rss_mb


def write_labelled_csv(sentences: list[tuple[str, str]], rows: int, path: Path) -> None:
    """`rows` labelled sentences as a CSV (text, label): VADER's in a seeded order (its file holds
    one source after another, amazon reviews first, so its first rows are shorter than the
    whole), repeated, every row marked with its copy number so no two rows are equal and every
    size has the same length distribution (throughput at 1× and 16× is then comparable)."""
    order = np.random.default_rng(0).permutation(len(sentences))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as stream:
        writer = csv.writer(stream)
        writer.writerow(["text", "label"])
        for index in range(rows):
            text, label = sentences[order[index % len(sentences)]]
            writer.writerow([f"{text} ({index // len(sentences)})", label])


def write_document_copies(works: list[str], copies: int, folder: Path) -> None:
    """`copies` copies of every work, one text file each (what a folder of documents looks like)."""
    for copy in range(copies):
        part = folder / f"copy{copy:03d}"
        part.mkdir(parents=True, exist_ok=True)
        for index, work in enumerate(works):
            (part / f"work{index:02d}.txt").write_text(work, encoding="utf-8")


@dataclass
class ScalePoint:
    scale: int  # multiple of the base dataset
    items: int  # tokens, images or sentences in the training split
    prepare_peak_mb: float  # the prepare command's own peak resident memory
    prepare_s: float
    worker_peak_mb: float  # the largest training worker's peak resident memory
    items_per_s: float  # training throughput (steady state)
    data_mb: float | None = None  # the prepared training split on disk, what training reads
    copied_mb: float | None = None  # what training copied to the node's own disk first


def run_measured(
    module: str, args: Sequence[str], out: Path, env: Mapping[str, str] | None = None
) -> tuple[float, float]:
    """Run `python -m module args` as its own process; its peak resident MiB and its seconds."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_testkit.scaling", str(out), "-m", module, *args],
        env=dict(env) if env is not None else None,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(
            f"{module} {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())["peak_rss_mb"], seconds


def scaling_table(pipeline: str, unit: str, points: list[ScalePoint]) -> str:
    """The figures as a table, then the ratios largest ÷ smallest dataset."""
    lines = [
        f"{pipeline}: memory and throughput as the dataset grows ({unit} in the training split)",
        f"{'scale':>6} {unit:>12} {'prepare MiB':>12} {'prepare s':>10} "
        f"{'worker MiB':>11} {unit + '/s':>12}",
    ]
    disk = all(p.data_mb is not None and p.copied_mb is not None for p in points)
    if disk:
        lines[-1] += f" {'data MB':>9} {'copied MB':>10}"
    for point in points:
        lines.append(
            f"{point.scale:>5}× {point.items:>12,} {point.prepare_peak_mb:>12.0f} "
            f"{point.prepare_s:>10.0f} {point.worker_peak_mb:>11.0f} {point.items_per_s:>12.1f}"
        )
        if disk:
            lines[-1] += f" {point.data_mb:>9.1f} {point.copied_mb:>10.1f}"
    small, large = points[0], points[-1]
    growth = (
        (large.worker_peak_mb - small.worker_peak_mb) * 2**20 / max(1, large.items - small.items)
    )
    lines += [
        f"prepare peak memory, {large.scale}× ÷ {small.scale}×: "
        f"{large.prepare_peak_mb / small.prepare_peak_mb:.2f}",
        f"training worker peak memory, {large.scale}× ÷ {small.scale}×: "
        f"{large.worker_peak_mb / small.worker_peak_mb:.2f} "
        f"(growth {growth:.2f} bytes per {unit.rstrip('s')})",
        f"training throughput, {large.scale}× ÷ {small.scale}×: "
        f"{large.items_per_s / small.items_per_s:.2f}",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """OUT -m MODULE ARGS…: run the module as `python -m` would, then record the peak memory."""
    if len(argv) < 3 or argv[1] != "-m":
        print("usage: python -m raytrain_testkit.scaling OUT -m MODULE [ARGS…]", file=sys.stderr)
        return 2
    out, module = Path(argv[0]), argv[2]
    sys.argv = [module, *argv[3:]]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    out.write_text(json.dumps({"peak_rss_mb": peak_rss_mb(), "exit": code}))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
