"""An image tree as it grows (`nox -s bench_images`): a synthetic tree of real JPEG files at 1×,
4× and 16× a base of 80,000 (16×: 1.28 M files, ImageNet's count), prepared in place and as
shards (`prepare --shards`), then trained to its first steps; each command a process of its own on
a fresh local Ray cluster, as a user runs them.

Printed for each scale and layout: prepare's seconds and its driver's peak resident memory, the
seconds from `train` to its first optimiser step (summary.json's `startup_s`), the train driver's
and the largest worker's peak memory; then the ratios to 1×. The goals (issue 43): memory within
1.2× and the first step within 1.5× from 1× to 16×, prepare time linear in the files.

The images are 16×16 RGB JPEGs of 100 classes (a colour per class, noise over it; 32 encodings per
class reused, so writing 1.28 M files takes a minute), trained at 28×28 for 10 steps.

    python -m benchmarks.mnist_resnet.bench_images [--scales 1,4,16] [--base 80000] [--folder DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from raytrain_testkit.scaling import run_measured

CLASSES = 100
VARIANTS = 32  # encodings per class, reused across the class's files
STEPS = 10


def jpeg_pool(seed: int = 0) -> list[list[bytes]]:
    """VARIANTS JPEG encodings of a 16×16 picture per class: the class's colour under noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(CLASSES):
        colour = rng.uniform(0, 255, 3)
        encoded = []
        for _ in range(VARIANTS):
            pixels = np.clip(colour + rng.normal(0, 40, (16, 16, 3)), 0, 255).astype(np.uint8)
            stream = io.BytesIO()
            Image.fromarray(pixels).save(stream, format="JPEG", quality=90)
            encoded.append(stream.getvalue())
        pool.append(encoded)
    return pool


def measure(tree: Path, root: Path, name: str, shards: bool) -> dict[str, float]:
    """One layout of one tree: prepare, then `train` to step STEPS, each measured."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    data_dir = root / f"data-{name}"
    prepare = ["prepare", "--source", str(tree), "--data-dir", str(data_dir)]
    prepare_mb, prepare_s = run_measured(
        "mnist_resnet", [*prepare, *(["--shards"] if shards else [])], root / f"p-{name}.json", env
    )
    train = [
        *("train", "--preset", "cpu", "--data-dir", str(data_dir), "--storage-path", str(root)),
        *("--run-name", f"run-{name}", "--stop-at-step", str(STEPS), "--tracking", "none"),
        *("--limit-val-rows", "512", "--limit-test-rows", "512"),
    ]
    driver_mb, _ = run_measured("mnist_resnet", train, root / f"t-{name}.json", env)
    summary = json.loads((root / f"run-{name}" / "summary.json").read_text())
    shutil.rmtree(data_dir, ignore_errors=True)
    return {
        "prepare_s": prepare_s,
        "prepare_mb": prepare_mb,
        "first_step_s": float(summary["startup_s"]),
        "driver_mb": driver_mb,
        "worker_mb": float(summary["worker_peak_rss_mb"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="1,4,16", help="multiples of the base")
    parser.add_argument("--base", type=int, default=80_000, help="files at 1×")
    parser.add_argument("--folder", help="where the trees and runs go (default: a temp folder)")
    args = parser.parse_args(argv)
    scales = sorted(int(s) for s in args.scales.split(","))
    pool = jpeg_pool()
    results: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-images-") as temporary:
        root = Path(args.folder or temporary)
        tree = root / "tree"
        if tree.exists():  # its files would count at every scale
            parser.error(f"{tree} exists: give a new or empty --folder")
        written = 0
        for scale in scales:  # the tree grows in place: the files of 1× are among 4×'s
            files = scale * args.base
            write_tree_part(tree, written, files, pool)
            written = files
            for layout in ("in place", "shards"):
                name = f"{scale}x-{'shards' if layout == 'shards' else 'tree'}"
                results[(layout, scale)] = measure(tree, root, name, layout == "shards")
                print(f"{name}: {results[(layout, scale)]}", flush=True)
    print(table(results, scales, args.base))
    return 0


def write_tree_part(tree: Path, start: int, stop: int, pool: list[list[bytes]]) -> None:
    """Files `start`..`stop` of a tree of CLASSES class folders (DIR/<class>/…: prepare carves
    the test and validation splits)."""
    for label in range(CLASSES):
        (tree / f"class{label:03d}").mkdir(parents=True, exist_ok=True)
    for index in range(start, stop):
        label = index % CLASSES
        data = pool[label][(index // CLASSES) % VARIANTS]
        (tree / f"class{label:03d}" / f"img{index:08d}.jpg").write_bytes(data)


def table(results: dict[tuple[str, int], dict[str, float]], scales: list[int], base: int) -> str:
    columns = ("prepare_s", "prepare_mb", "first_step_s", "driver_mb", "worker_mb")
    header = f"{'layout':9} {'scale':>5} {'files':>10} " + " ".join(f"{c:>13}" for c in columns)
    lines = [header]
    for (layout, scale), row in sorted(results.items(), key=lambda item: (item[0][0], item[0][1])):
        cells = " ".join(f"{row[c]:>13.1f}" for c in columns)
        lines.append(f"{layout:9} {scale:>4}× {scale * base:>10,} {cells}")
    for layout in ("in place", "shards"):
        small, large = results[(layout, scales[0])], results[(layout, scales[-1])]
        ratios = " ".join(f"{c} {large[c] / small[c]:.2f}" for c in columns)
        lines.append(f"{layout}, {scales[-1]}× ÷ {scales[0]}×: {ratios}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
