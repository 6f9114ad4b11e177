"""`python -m benchmarks.mnist_resnet.bench_augment --source TREE`: which augmentation to train an RGB image
tree with, measured. The tree is prepared once; each recipe (none, the photo recipe at two crop
scales, the pad-and-crop with flip) trains from the same weights' seed for each epoch count on one
cluster, and the table prints the chosen checkpoint's test accuracy and the last epoch's training
accuracy (an underfit run has both low). `--augment auto` takes what this table supports."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any

from mnist_resnet.config import cpu_preset
from mnist_resnet.prepare import prepare
from mnist_resnet.train import run
from raytrain_common.storage import resolve_storage

RECIPES: dict[str, dict[str, Any]] = {
    "none": {"augment": "none"},
    "photo, scale 0.08..1": {"augment": "photo", "crop_scale": 0.08},
    "photo, scale 0.35..1": {"augment": "photo", "crop_scale": 0.35},
    "photo, scale 0.6..1": {"augment": "photo", "crop_scale": 0.6},
    "crop-flip": {"augment": "crop-flip"},
}


def measure(
    source: str, image_size: int, epochs: list[int], folder: Path, recipes: list[str]
) -> list[dict[str, Any]]:
    """One row per (recipe, epochs): test accuracy of the checkpoint chosen on validation."""
    data_dir = resolve_storage(folder / "data")
    prepare(source, data_dir, folder / "download", image_size=image_size)
    rows = []
    for count in epochs:
        for name in recipes:
            changes = RECIPES[name]
            config = dataclasses.replace(
                cpu_preset(),
                storage_path=str(folder / "runs"),
                data_dir=data_dir.uri,
                run_name=f"{name.split(',')[0]}-{changes.get('crop_scale', 0)}-{count}",
                epochs=count,
                global_batch_size=64,
                lr=0.05,
                tracking="none",
                **changes,
            )
            summary = run(config)
            rows.append(
                {
                    "recipe": name,
                    "epochs": count,
                    "test_accuracy": summary["test"]["test_accuracy"],
                    "train_accuracy": summary["final"]["train_accuracy"],
                    "val_accuracy": summary["best"]["val_accuracy"],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="an RGB class-per-folder image tree")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--epochs", default="4,12", help="epoch counts, comma-separated")
    parser.add_argument(
        "--recipes", default=";".join(RECIPES), help=f"';'-separated, of: {'; '.join(RECIPES)}"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-augment-") as folder:
        epochs = [int(count) for count in args.epochs.split(",")]
        recipes = args.recipes.split(";")
        rows = measure(args.source, args.image_size, epochs, Path(folder), recipes)
    print("| recipe | epochs | test accuracy | train accuracy (last epoch) | best val accuracy |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['recipe']} | {row['epochs']} | {row['test_accuracy']:.3f} | "
            f"{row['train_accuracy']:.3f} | {row['val_accuracy']:.3f} |"
        )


if __name__ == "__main__":
    main()
