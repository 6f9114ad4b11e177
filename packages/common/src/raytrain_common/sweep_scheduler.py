"""ASHA that still remembers its rungs after an interrupted sweep is resumed.

Tune saves its trials and its searcher when it checkpoints an experiment, but not the scheduler:
`Tuner.restore` brings back the ASHA the sweep was created with, and its rungs are empty. A resumed
sweep then judges its remaining trials only against each other, never against the trials that
reached a rung before the interruption: a lagging trial that is the first to reach a rung after
the restart runs to the end. Every trial writes its evaluations to its own run folder (the
metrics.csv of its run), so on resume each trial Tune restores has its earlier evaluations entered
into the rungs again (to the 6 significant digits metrics.csv keeps: only an exact tie with a
later trial can be judged otherwise than the first time).

Kept apart from `raytrain_common.sweep` so that the workers, which import the sweep settings with
each pipeline's config, do not import Ray Tune.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ray.tune.schedulers import ASHAScheduler

from raytrain_common.metrics import METRICS_FILE, read_metrics_csv
from raytrain_common.storage import resolve_storage

if TYPE_CHECKING:
    from ray.tune.experiment import Trial

log = logging.getLogger(__name__)


class ResumableASHA(ASHAScheduler):
    """ASHAScheduler whose rungs are rebuilt from the trials' run folders when Tune restores them.

    `trials_uri` is the folder holding one run folder per trial, named by trial id.
    """

    def __init__(self, trials_uri: str, **asha: Any) -> None:
        super().__init__(**asha)
        self.trials_uri = trials_uri
        self.replayed_evaluations = 0

    def on_trial_add(self, tune_controller: Any, trial: Trial) -> None:
        super().on_trial_add(tune_controller, trial)
        history = self.evaluations_so_far(trial.trial_id)
        bracket = self._trial_info[trial.trial_id]
        for when, value in history:
            # What ASHA decided at the time stands (the trial ended, or it goes on from its
            # checkpoint); only the record of the value is wanted here, for later trials' cutoffs.
            bracket.on_result(trial, when, self._metric_op * value)
        self.replayed_evaluations += len(history)
        if history:
            log.info(
                "ASHA: trial %s's %d evaluations before the interruption are back in its rungs",
                trial.trial_id, len(history),
            )  # fmt: skip

    def evaluations_so_far(self, trial_id: str) -> list[tuple[float, float]]:
        """(progress, metric) of every evaluation the trial's run folder holds; none for a trial
        that had not started."""
        metrics = resolve_storage(self.trials_uri).join(trial_id, METRICS_FILE)
        if not metrics.exists():
            return []
        return [
            (row[self._time_attr], row[self._metric])
            for row in read_metrics_csv(metrics)
            if self._time_attr in row and self._metric in row
        ]
