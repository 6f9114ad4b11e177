"""The classifier's scores, shared by training (every evaluation) and `evaluate` (the test split)."""

from __future__ import annotations

import numpy as np


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_labels: int) -> np.ndarray:
    """Rows: true class; columns: predicted class."""
    matrix = np.zeros((num_labels, num_labels), dtype=np.int64)
    np.add.at(matrix, (labels, predictions), 1)
    return matrix


def classification_scores(
    labels: np.ndarray, predictions: np.ndarray, num_labels: int
) -> dict[str, float]:
    """Accuracy and macro F1 (the mean of per-class F1, so a small class counts as much as a big one)."""
    matrix = confusion_matrix(labels, predictions, num_labels)
    true_positive = np.diag(matrix).astype(float)
    precision = np.divide(
        true_positive, matrix.sum(0), out=np.zeros(num_labels), where=matrix.sum(0) > 0
    )
    recall = np.divide(
        true_positive, matrix.sum(1), out=np.zeros(num_labels), where=matrix.sum(1) > 0
    )
    f1 = np.divide(
        2 * precision * recall,
        precision + recall,
        out=np.zeros(num_labels),
        where=(precision + recall) > 0,
    )
    return {"accuracy": float(true_positive.sum() / matrix.sum()), "f1": float(f1.mean())}
