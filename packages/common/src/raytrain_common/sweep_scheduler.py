"""ASHA that still remembers its rungs after an interrupted sweep is resumed.

Tune saves its trials and its searcher when it checkpoints an experiment, but not the scheduler:
`Tuner.restore` brings back the ASHA the sweep was created with, and its rungs are empty. A resumed
sweep then judges its remaining trials only against each other, never against the trials that
reached a rung before the interruption: a lagging trial that is the first to reach a rung after
the restart runs to the end. So the rungs are written to the sweep folder whenever ASHA records a
value (the values it compared, exactly, as JSON keeps floats) and read back when the restored
sweep adds its first trial. The trials' own run folders would not do: hf-finetune and llm-fsdp
write metrics.csv when a run ends, and a trial ASHA stopped never gets there. Nor would a file at
the top of the sweep folder: Tune copies that level's .json files to its staging folder when it
restores and copies them back up as it syncs, over anything written there since (measured: the
rungs file went back to what it held at the restart).

Kept apart from `raytrain_common.sweep` so that the workers, which import the sweep settings with
each pipeline's config, do not import Ray Tune.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from ray.tune.schedulers import ASHAScheduler

from raytrain_common.configs import ConfigError
from raytrain_common.storage import StoragePath, resolve_storage

if TYPE_CHECKING:
    from ray.tune.experiment import Trial

log = logging.getLogger(__name__)

RUNGS_FILE = "scheduler/asha_rungs.json"  # under the sweep folder, a level Tune does not sync

# Per bracket, per rung: [milestone, {trial id: the value ASHA recorded (sign-adjusted by mode)}].
Rungs = list[list[tuple[float, dict[str, float]]]]


class ResumableASHA(ASHAScheduler):
    """ASHAScheduler that keeps its rungs in `<sweep_uri>/scheduler/asha_rungs.json` and, once
    restored with its sweep, starts from them.

    A new sweep in a folder must not inherit an older sweep's rungs: `forget_rungs` removes them.
    """

    def __init__(self, sweep_uri: str, **asha: Any) -> None:
        super().__init__(**asha)
        self.sweep_uri = sweep_uri
        self._rungs_read = False
        self._values_written = 0

    @property
    def rungs_file(self) -> StoragePath:
        return resolve_storage(self.sweep_uri).join(RUNGS_FILE)

    def forget_rungs(self) -> None:
        target = self.rungs_file
        if target.exists():
            target.filesystem.delete_file(target.path)

    def on_trial_add(self, tune_controller: Any, trial: Trial) -> None:
        if not self._rungs_read:  # the first trial of a run of the sweep, new or restored
            self._rungs_read = True
            self._read_rungs()
        super().on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller: Any, trial: Trial, result: dict[str, Any]) -> str:
        decision = super().on_trial_result(tune_controller, trial, result)
        self._write_rungs_if_changed()
        return decision

    def on_trial_complete(self, tune_controller: Any, trial: Trial, result: dict[str, Any]) -> None:
        super().on_trial_complete(tune_controller, trial, result)
        self._write_rungs_if_changed()

    def _rungs(self) -> Rungs:
        return [list(bracket._rungs) for bracket in self._brackets]

    def _value_count(self) -> int:
        return sum(len(recorded) for bracket in self._rungs() for _, recorded in bracket)

    def _write_rungs_if_changed(self) -> None:
        values = self._value_count()
        if values != self._values_written:  # a value is only ever added to a rung
            self.rungs_file.write_text(json.dumps(self._rungs()))
            self._values_written = values

    def _read_rungs(self) -> None:
        if not self.rungs_file.exists():
            return
        saved = json.loads(self.rungs_file.read_text())
        expected = [[milestone for milestone, _ in bracket] for bracket in self._rungs()]
        found = [[milestone for milestone, _ in bracket] for bracket in saved]
        if found != expected:
            raise ConfigError(
                f"{self.rungs_file.uri} holds ASHA rungs at {found}, this sweep's are at "
                f"{expected}: the file is another sweep's; remove it, or choose another "
                "--sweep-name"
            )
        trials: set[str] = set()
        for bracket, saved_bracket in zip(self._rungs(), saved, strict=True):
            for (_, recorded), (_, saved_recorded) in zip(bracket, saved_bracket, strict=True):
                recorded.update(saved_recorded)
                trials.update(saved_recorded)
        self._values_written = self._value_count()
        log.info(
            "ASHA: %d evaluations of %d trials from before the interruption are back in its rungs",
            self._values_written,
            len(trials),
        )
