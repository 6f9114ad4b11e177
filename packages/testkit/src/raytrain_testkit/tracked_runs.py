"""What a test reads back from the MLflow store a run wrote."""

from __future__ import annotations

from raytrain_common.storage import StoragePath
from raytrain_common.tracking import RUN_DIR_TAG, client, default_tracking_uri


def metric_history(storage: StoragePath, experiment: str, run_dir: StoragePath, key: str) -> dict:
    """What the default store holds for a run folder: {"runs": MLflow runs tracking it, "steps":
    [(step, value), …] of `key` in the first}. For checks and scripts; the UI shows the same."""
    uri = default_tracking_uri(storage)
    if uri is None:
        raise ValueError(f"no default MLflow store for {storage.uri}")
    mlflow_client = client(uri)
    found = mlflow_client.get_experiment_by_name(experiment)
    if found is None:
        return {"runs": [], "steps": []}
    quoted = run_dir.uri.replace("'", "\\'")
    runs = mlflow_client.search_runs(
        [found.experiment_id], filter_string=f"tags.`{RUN_DIR_TAG}` = '{quoted}'"
    )
    steps = (
        [(m.step, m.value) for m in mlflow_client.get_metric_history(runs[0].info.run_id, key)]
        if runs
        else []
    )
    return {"runs": runs, "steps": steps}
