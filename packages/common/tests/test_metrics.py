from __future__ import annotations

import json
from pathlib import Path

from raytrain_common.metrics import (
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
