from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from raytrain_common.metrics import (
    classification_scores,
    confusion_matrix,
    package_versions,
    plot_curves,
    read_metrics_csv,
    write_metrics_csv,
    write_summary,
)
from raytrain_common.storage import resolve_storage


def test_csv_round_trip_with_columns_added_later(tmp_path: Path) -> None:
    target = resolve_storage(tmp_path / "metrics.csv")
    rows = [{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.25, "accuracy": 0.9}]
    write_metrics_csv(target, rows)
    assert read_metrics_csv(target) == [
        {"epoch": 1.0, "loss": 0.5},
        {"epoch": 2.0, "loss": 0.25, "accuracy": 0.9},
    ]


def test_plot_is_a_png(tmp_path: Path) -> None:
    target = resolve_storage(tmp_path / "curves.png")
    rows = [{"epoch": 1, "loss": 1.0, "acc": 0.5}, {"epoch": 2, "loss": 0.5, "acc": 0.8}]
    plot_curves(target, rows, [("loss", ["loss"]), ("accuracy", ["acc", "absent"])])
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_is_json_with_versions(tmp_path: Path) -> None:
    target = resolve_storage(tmp_path / "summary.json")
    write_summary(target, {"best": {"accuracy": 0.99}, "versions": package_versions("numpy")})
    summary = json.loads(target.read_text())
    assert summary["best"]["accuracy"] == 0.99
    assert summary["versions"]["ray"] == "2.60.0"
    assert "written_at" in summary


def test_macro_f1_weighs_a_small_class_as_much_as_a_large_one() -> None:
    """9 of class 0 right, the one row of class 1 missed: accuracy 0.9, macro F1 the mean of
    class 0's F1 (18/19) and class 1's (0)."""
    labels = np.array([0] * 9 + [1])
    predictions = np.zeros(10, dtype=np.int64)
    assert confusion_matrix(labels, predictions, 2).tolist() == [[9, 0], [1, 0]]
    scores = classification_scores(labels, predictions, 2)
    assert scores["accuracy"] == pytest.approx(0.9)
    assert scores["f1"] == pytest.approx((18 / 19 + 0) / 2)
    assert classification_scores(labels, labels, 3)["f1"] == pytest.approx(2 / 3)  # class 2: none
