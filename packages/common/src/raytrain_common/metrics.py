"""What a run leaves for people and scripts: a per-epoch CSV, a PNG of the curves, summary.json."""

from __future__ import annotations

import csv
import io
import json
import platform
import time
from collections.abc import Collection, Mapping, Sequence
from importlib import metadata
from typing import Any

import numpy as np

from raytrain_common.storage import StoragePath, write_atomic

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.csv"  # every pipeline's table of evaluations, in its run folder
CURVES_FILE = "curves.png"


def write_metrics_csv(target: StoragePath, rows: Sequence[Mapping[str, Any]]) -> None:
    """Rewrite the whole CSV atomically: one row per epoch, columns in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: _format(value) for key, value in row.items()})
    target.write_text(buffer.getvalue())


def read_metrics_csv(source: StoragePath) -> list[dict[str, float]]:
    """Rows of a metrics CSV as numbers."""
    reader = csv.DictReader(io.StringIO(source.read_text()))
    return [{key: float(value) for key, value in row.items() if value != ""} for row in reader]


def plot_curves(
    target: StoragePath,
    rows: Sequence[Mapping[str, float]],
    panels: Sequence[tuple[str, Sequence[str]]],
    *,
    x: str = "epoch",
    title: str = "",
    log_y: Collection[str] = (),
) -> None:
    """One PNG with a panel per (y label, metric names); metrics missing from the rows are skipped.

    Panels whose label is in `log_y` get a log scale: losses span decades within one run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for axis, (label, names) in zip(axes[0], panels, strict=True):
        for name in names:
            points = [(row[x], row[name]) for row in rows if name in row and x in row]
            if points:
                xs, ys = zip(*points, strict=True)
                axis.plot(xs, ys, marker="o", label=name)
        axis.set_xlabel(x)
        axis.set_ylabel(label)
        if label in log_y:
            axis.set_yscale("log")
        axis.grid(alpha=0.3)
        axis.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    target.write_bytes(buffer.getvalue())


def package_versions(*names: str) -> dict[str, str]:
    """Versions of Python and the named distributions, for summaries people compare."""
    versions = {"python": platform.python_version()}
    for name in ("ray", "torch", "pyarrow", *names):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def write_summary(target: StoragePath, summary: Mapping[str, Any]) -> None:
    """Write summary.json atomically, stamped with the time it was written."""
    content = {"written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **summary}
    target.write_text(json.dumps(content, indent=2, sort_keys=False, default=str) + "\n")


def _format(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def eta(remaining_steps: int, seconds_per_step: float) -> str:
    """ "ETA 4m05s" for a progress line: the steps left at the recent pace (evaluations
    excluded)."""
    seconds = max(0, round(remaining_steps * seconds_per_step))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"ETA {hours}h{minutes:02d}m" if hours else f"ETA {minutes}m{seconds:02d}s"


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_labels: int) -> np.ndarray:
    """Counts of (true class, predicted class): rows the true class, columns the predicted one."""
    matrix = np.zeros((num_labels, num_labels), dtype=np.int64)
    np.add.at(matrix, (labels, predictions), 1)
    return matrix


def classification_scores(
    labels: np.ndarray, predictions: np.ndarray, num_labels: int
) -> dict[str, float]:
    """Accuracy and macro F1 (the mean of per-class F1, so a small class counts as much as a big
    one; a class never predicted nor present scores 0)."""
    matrix = confusion_matrix(labels, predictions, num_labels).astype(float)
    hits, predicted, actual = np.diag(matrix), matrix.sum(0), matrix.sum(1)
    zeros = np.zeros(num_labels)
    precision = np.divide(hits, predicted, out=zeros.copy(), where=predicted > 0)
    recall = np.divide(hits, actual, out=zeros.copy(), where=actual > 0)
    both = precision + recall
    f1 = np.divide(2 * precision * recall, both, out=zeros.copy(), where=both > 0)
    return {"accuracy": float(hits.sum() / matrix.sum()), "f1": float(f1.mean())}


def plot_confusion_matrix(
    target: StoragePath,
    matrix: Any,  # (classes, classes) counts: row = true class, column = predicted
    labels: list[str],
    accuracy: float,
    macro_f1: float,
    title: str,
) -> None:
    """A classifier's confusion matrix as a PNG: counts in the cells, each row shaded by its share
    of the true class, accuracy and macro F1 in the title; written atomically."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = 2.5 + 0.6 * len(labels)
    figure, axes = plt.subplots(figsize=(size + 1, size))
    shares = matrix / np.maximum(matrix.sum(1, keepdims=True), 1)
    image = axes.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    for (row, column), count in np.ndenumerate(matrix):
        colour = "white" if shares[row, column] > 0.5 else "black"
        axes.text(column, row, f"{count}", ha="center", va="center", color=colour)
    axes.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    axes.set_yticks(range(len(labels)), labels)
    axes.set_xlabel("predicted")
    axes.set_ylabel("true")
    axes.set_title(
        f"{title}: accuracy {accuracy:.3f}, macro F1 {macro_f1:.3f}",
        fontsize=9,
    )
    figure.colorbar(image, ax=axes, label="share of the true class")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    write_atomic(target, lambda stream: stream.write(buffer.getvalue()))
