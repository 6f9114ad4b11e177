"""Load a run's best checkpoint (chosen on the validation split): measure its test accuracy, draw
test images with their predictions, or classify the user's own image files: one file at once in
this process, a folder or bucket of any size as Ray Data batch inference written to Parquet."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow.dataset as pads
import ray.data
import torch

from mnist_resnet.config import TRAIN_COMMAND
from mnist_resnet.task import as_nchw, build_model, evaluate, normalise, on_device
from raytrain_common.checkpoint import load_model_weights, load_remote_state
from raytrain_common.images.dataset import DataError, DatasetInfo
from raytrain_common.images.decode import SKIPPED_LABEL
from raytrain_common.images.files import IMAGE_SUFFIXES, load_image
from raytrain_common.images.stream import ImageData
from raytrain_common.inference import check_paths, predict_to_parquet
from raytrain_common.ray_start import init_ray
from raytrain_common.runs import chosen_checkpoint
from raytrain_common.storage import StoragePath, resolve_storage

PREDICT_BATCH = 1024  # test images per forward pass in `predict`


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


def trained_model(state: dict[str, Any]) -> torch.nn.Module:
    """The checkpoint's model, on the CPU: its architecture (classes, channels, --model-width;
    a checkpoint written before --model-width existed has none: 64) with its weights loaded."""
    info = DatasetInfo(**state["dataset"])
    model = build_model(info.num_classes, info.channels, state["config"].get("model_width", 64))
    load_model_weights(model, state["model"])
    return model


def read_split(state: dict[str, Any], split: str, limit: int | None = None) -> ray.data.Dataset:
    """A split of the checkpoint's dataset, decoded by Ray Data, in no particular order."""
    data = ImageData(state["config"]["data_dir"], state["dataset"], run_dir="", seed=0)
    return data.split(split, limit)


def checkpoint_test_metrics(checkpoint_uri: str, limit: int | None = None) -> dict[str, Any]:
    """Test loss and accuracy of one checkpoint, on this process's GPU if it has one: what train
    reports once for the checkpoint chosen on the validation split (run in a Ray task there)."""
    metrics = checkpoint_split_metrics(resolve_storage(checkpoint_uri), "test", limit)
    return {**metrics, "checkpoint": checkpoint_uri}


def checkpoint_split_metrics(
    checkpoint: StoragePath, split: str, limit: int | None = None
) -> dict[str, Any]:
    """`<split>_loss`, `<split>_accuracy` and `<split>_rows` of one checkpoint over a split's first
    `limit` rows (all: None), decoded by Ray Data, on this process's GPU if it has one."""
    state = load_remote_state(checkpoint)
    info = DatasetInfo(**state["dataset"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = trained_model(state).to(device)
    seen = 0

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        nonlocal seen
        rows = read_split(state, split, limit)
        for batch in rows.iter_torch_batches(batch_size=512, device="cpu"):
            seen += int((batch["label"] != SKIPPED_LABEL).sum())  # undecodable files left out
            yield on_device(batch, info, device)

    bf16 = bool(state["config"].get("bf16")) and device.type == "cuda"
    metrics = evaluate(model, batches(), device, bf16, split=split)
    return {
        **metrics,
        f"{split}_rows": seen,
        "epoch": state["history"][-1]["epoch"] if state["history"] else 0,
        "step": state["step"],
    }


def load_best_model(
    run_dir: StoragePath, which: Literal["best", "latest"] = "best"
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model of the run's best checkpoint (by validation accuracy) or its latest, on the CPU,
    in eval mode; a torn checkpoint (files not matching its manifest) is refused with one line."""
    state = load_remote_state(resolve_storage(chosen_checkpoint(run_dir, which, TRAIN_COMMAND)))
    return trained_model(state).eval(), state


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


@torch.no_grad()
def predict(storage_path: str, run_name: str, count: int, output: str | None) -> dict[str, Any]:
    """Test accuracy of the run's best checkpoint and a picture of `count` test images: the first
    ones by row, then mistakes. The test split streams through Ray Data a batch at a time, so memory
    holds one batch and the pictured images, whatever the split's size."""
    run_dir = resolve_storage(storage_path).join(run_name)
    model, state = load_best_model(run_dir)
    info = DatasetInfo(**state["dataset"])
    init_ray(train_cpus=1)  # as every command starts Ray: Ray Data's own lines off the console
    head = min(count - count // 4, info.test_rows)
    correct = seen = 0
    # (row, image, label, predicted): rows below `head` all, then mistakes, `count` in all.
    shown: list[tuple[int, np.ndarray, int, int]] = []
    for batch in read_split(state, "test").iter_torch_batches(
        batch_size=PREDICT_BATCH, device="cpu"
    ):
        images = normalise(batch["image"], info.mean, info.std)
        predicted = model(images).argmax(1).numpy()
        labels, rows = batch["label"].numpy(), batch["row"].numpy()
        usable = labels != SKIPPED_LABEL  # a file that could not be decoded is left out
        correct += int((predicted == labels).sum())
        seen += int(usable.sum())
        pixels = batch["image"].numpy()
        for i in np.flatnonzero(usable & ((rows < head) | (predicted != labels))):
            shown.append((int(rows[i]), pixels[i], int(labels[i]), int(predicted[i])))
        shown.sort(key=lambda item: (item[0] >= head, item[0]))
        del shown[count:]
    pixels = np.stack([item[1] for item in shown])  # (n, C, H, W) uint8
    pixels = pixels[:, 0] if info.channels == 1 else pixels.transpose(0, 2, 3, 1)
    picture = resolve_storage(output) if output else run_dir.join("predictions.png")
    labels, guesses = (np.array([item[i] for item in shown]) for i in (2, 3))
    draw_predictions(picture, pixels, labels, guesses, info)
    return {
        "test_accuracy": correct / seen,
        "test_rows": seen,
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


class ImageClassifier:
    """A Ray Data actor holding one model: loaded once from the checkpoint, then fed batches of
    image files (their bytes and paths) and answering a prediction, or the error, for each."""

    def __init__(self, checkpoint_uri: str) -> None:
        state = load_remote_state(resolve_storage(checkpoint_uri))
        self.info = DatasetInfo(**state["dataset"])
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = trained_model(state).to(self.device).eval()
        self.blank = np.zeros(
            (self.info.height, self.info.height) + ((3,) if self.info.channels == 3 else ()),
            np.uint8,
        )

    @torch.no_grad()
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels, errors = [], []
        for data in batch["bytes"]:
            try:
                pixels.append(load_image(io.BytesIO(data), self.info.height, self.info.channels))
                errors.append("")
            except (OSError, ValueError, SyntaxError) as error:  # PIL's decoders raise all three
                pixels.append(self.blank)
                errors.append(f"cannot be read as an image ({type(error).__name__}: {error})")
        images = normalise(as_nchw(np.stack(pixels)), self.info.mean, self.info.std)
        probabilities = torch.softmax(self.model(images.to(self.device)).float(), dim=1).cpu()
        best, indices = probabilities.max(dim=1)
        failed = np.array([bool(error) for error in errors])
        classes = np.where(failed, -1, indices.numpy())
        return {
            "path": batch["path"],
            "class_index": classes,
            "label": np.array(
                ["" if index < 0 else self.info.class_name(int(index)) for index in classes],
                dtype=object,
            ),
            "probability": np.where(failed, np.nan, best.numpy()),
            "error": np.array(errors, dtype=object),
        }


def predict_files(
    storage_path: str,
    run_name: str,
    location: str,
    output: str,
    batch_size: int = 256,
) -> dict[str, Any]:
    """Batch inference with Ray Data: every image file under `location` (a folder or a bucket
    prefix, at any depth) read by Ray Data's tasks, classified by a pool of actors holding one model
    each (a GPU each where the cluster has them), and written to `output` as Parquet: one row per
    file (path, class_index, label, probability, error). Memory stays bounded by the batches in
    flight, not the number of files. A killed actor is restarted and its batches retried, so no
    file is lost or written twice. A local `output` appears whole or not at all."""
    source, target = check_paths(location, output)
    checkpoint = chosen_checkpoint(
        resolve_storage(storage_path).join(run_name), "best", TRAIN_COMMAND
    )
    load_remote_state(resolve_storage(checkpoint))  # a torn checkpoint: refused here, in one line
    init_ray(train_cpus=1)
    files = ray.data.read_binary_files(
        source.path,
        include_paths=True,
        filesystem=source.filesystem,
        file_extensions=[suffix.lstrip(".") for suffix in IMAGE_SUFFIXES],
    )
    model = {"checkpoint_uri": checkpoint}
    written, seconds = predict_to_parquet(files, ImageClassifier, model, batch_size, target)
    rows = written.count_rows()  # counted from the Parquet by a scan: one row per file, any number
    return {
        "files": rows,
        "unreadable": written.count_rows(filter=pads.field("error") != ""),
        "output": target.uri,
        "checkpoint": checkpoint,
        "seconds": seconds,
        "files_per_s": rows / seconds if seconds else None,
    }
