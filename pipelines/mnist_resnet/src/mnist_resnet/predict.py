"""Load a run's best checkpoint (chosen on the validation split): measure its test accuracy, draw
test images with their predictions, or classify the user's own image files."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from mnist_resnet.data import (
    DataError,
    DatasetInfo,
    ImageRows,
    as_nchw,
    normalise,
    read_split_arrays,
)
from mnist_resnet.images import IMAGE_SUFFIXES, load_image
from mnist_resnet.task import build_model, evaluate
from raytrain_common.checkpoint import load_model_weights, load_remote_state
from raytrain_common.metrics import SUMMARY_FILE
from raytrain_common.storage import StoragePath, resolve_storage


@torch.no_grad()
def predict_labels(
    model: torch.nn.Module,
    images: np.ndarray,
    info: DatasetInfo,
    device: torch.device,
    batch_size: int = 1000,
) -> np.ndarray:
    """Predicted class of each uint8 image (N, H, W) or (N, H, W, 3) held in memory."""
    model.eval()
    predicted = []
    for start in range(0, len(images), batch_size):
        batch = as_nchw(images[start : start + batch_size])
        predicted.append(model(normalise(batch, info.mean, info.std).to(device)).argmax(1).cpu())
    return torch.cat(predicted).numpy()


def evaluate_arrays(
    model: torch.nn.Module,
    images: np.ndarray,
    labels: np.ndarray,
    info: DatasetInfo,
    device: torch.device,
) -> float:
    """Accuracy of `model` on uint8 images (N, H, W) held in memory."""
    return float((predict_labels(model, images, info, device) == labels).mean())


def checkpoint_test_metrics(checkpoint_uri: str, limit: int | None = None) -> dict[str, Any]:
    """Test loss and accuracy of one checkpoint, on this process's GPU if it has one: what train
    reports once for the checkpoint chosen on the validation split (run in a Ray task there)."""
    state = load_remote_state(resolve_storage(checkpoint_uri))
    info = DatasetInfo(**state["dataset"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(info.num_classes, info.channels)
    load_model_weights(model, state["model"])
    model.to(device)
    rows = ImageRows.read(resolve_storage(state["config"]["data_dir"]), "test", limit)
    batches = (
        rows.batch(np.arange(i, min(i + 512, len(rows))), device) for i in range(0, len(rows), 512)
    )
    bf16 = bool(state["config"].get("bf16")) and device.type == "cuda"
    metrics = evaluate(model, batches, device, bf16, split="test")
    return {
        **metrics,
        "test_rows": len(rows),
        "checkpoint": checkpoint_uri,
        "epoch": state["history"][-1]["epoch"] if state["history"] else 0,
        "step": state["step"],
    }


def load_best_model(
    run_dir: StoragePath, which: Literal["best", "latest"] = "best"
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model of the run's best checkpoint (by validation accuracy) or its latest, on the CPU,
    in eval mode; a torn checkpoint (files not matching its manifest) is refused with one line."""
    summary_file = run_dir.join(SUMMARY_FILE)
    if not summary_file.exists():
        raise FileNotFoundError(
            f"no {SUMMARY_FILE} in {run_dir}: train first (`mnist-resnet train --run-name "
            f"{run_dir.uri.rsplit('/', 1)[-1]}`), or pass the right --storage-path / --run-name"
        )
    summary = json.loads(summary_file.read_text())
    chosen = summary.get("best_checkpoint") if which == "best" else None
    state = load_remote_state(resolve_storage(chosen or summary["latest_checkpoint"]))
    info = DatasetInfo(**state["dataset"])
    model = build_model(info.num_classes, info.channels)
    load_model_weights(model, state["model"])
    return model.eval(), state


def draw_predictions(
    target: StoragePath,
    images: np.ndarray,
    labels: np.ndarray,
    predicted: np.ndarray,
    info: DatasetInfo,
    columns: int = 8,
) -> None:
    """A grid of images titled 'predicted (true)' by class name; mistakes in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (len(images) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(columns * 1.3, rows * 1.5), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for axis, image, label, guess in zip(axes.flat, images, labels, predicted, strict=False):
        axis.imshow(image, cmap="gray" if image.ndim == 2 else None)
        title = f"{info.class_name(guess)} ({info.class_name(label)})"
        axis.set_title(title, fontsize=8, color="black" if guess == label else "red")
    figure.suptitle("predicted (true); mistakes in red")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    target.write_bytes(buffer.getvalue())


def predict(storage_path: str, run_name: str, count: int, output: str | None) -> dict[str, Any]:
    run_dir = resolve_storage(storage_path).join(run_name)
    model, state = load_best_model(run_dir)
    info = DatasetInfo(**state["dataset"])
    data_dir = resolve_storage(state["config"]["data_dir"])
    test = read_split_arrays(data_dir, "test")
    predicted = predict_labels(model, test.images, info, torch.device("cpu"))
    accuracy = float((predicted == test.labels).mean())
    # The first digits of the test set, as the tutorial shows them, then some of the mistakes.
    head = min(count - count // 4, len(test.labels))
    mistakes = np.flatnonzero(predicted != test.labels)
    shown = np.concatenate([np.arange(head), mistakes[mistakes >= head][: count - head]])
    picture = resolve_storage(output) if output else run_dir.join("predictions.png")
    draw_predictions(picture, test.images[shown], test.labels[shown], predicted[shown], info)
    return {
        "test_accuracy": accuracy,
        "test_rows": len(test.labels),
        "epochs_done": state["history"][-1]["epoch"] if state["history"] else 0,
        "picture": picture.uri,
    }


def image_files(location: str) -> list[Path]:
    """The images to classify: one file, or a folder's image files at any depth (sorted)."""
    path = Path(location).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"--input {location!r}: no such file or folder")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise DataError(f"--input {location!r} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return files


@torch.no_grad()
def classify_files(
    storage_path: str, run_name: str, location: str, batch_size: int = 256
) -> list[tuple[str, str, float]]:
    """(file, predicted class, probability) for each image, prepared exactly as training's were."""
    model, state = load_best_model(resolve_storage(storage_path).join(run_name))
    info = DatasetInfo(**state["dataset"])
    files = image_files(location)
    results = []
    for start in range(0, len(files), batch_size):
        chunk = files[start : start + batch_size]
        pixels = []
        for file in chunk:
            try:
                pixels.append(load_image(str(file), info.height, info.channels))
            except (OSError, ValueError, SyntaxError) as error:
                raise DataError(f"{file} cannot be read as an image ({error})") from error
        batch = normalise(as_nchw(np.stack(pixels)), info.mean, info.std)
        probabilities = torch.softmax(model(batch).float(), dim=1)
        best, labels = probabilities.max(dim=1)
        for file, label, probability in zip(chunk, labels.tolist(), best.tolist(), strict=True):
            results.append((str(file), info.class_name(label), probability))
    return results
