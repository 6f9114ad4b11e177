"""What a command's console may not carry unless --verbose: Ray's own INFO narration (Ray Data's
plans, estimates and progress bars, Ray Train's worker-group start, Ray's start banner), Python
warnings raised in our calls (deprecations, user warnings), and the token notice a local cluster
prints on every start. Tests run each command of each pipeline and assert `console_noise(...)` is
empty; a line that has to stay is said, with its reason, in raytrain_common.ray_start."""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

NOISE = (
    # Ray's logging format: "<date> <time>\tINFO <file>.py:<line> -- <message>".
    re.compile(r"\bINFO \S+\.py:\d+ -- "),
    re.compile(r"\bINFO (mlflow|alembic)\b"),  # MLflow's "<date> <time> INFO mlflow.…: …"
    re.compile(r"\bWARNING authentication_token_setup\.py"),
    re.compile(r"\b\w*(Deprecation|User|Future|Runtime)Warning\b"),
    # Ray Data and Ray Train narration, whichever process streams it.
    re.compile(
        r"(Starting execution of Dataset|Execution plan of Dataset|Progress bars disabled|"
        r"execution finished in|Estimated parquet|Running Dataset|Parquet dataset sampling|"
        r"Requesting resources|Attempting to start training worker group|"
        r"Started training worker group|Setting up process group|Started a local Ray instance|"
        r"A run snapshot was found|Moving model to device|Wrapping provided model|"
        r"async validation task|(Running|Staged) validations for checkpoint)"
    ),
    re.compile(r"\d+%\|"),  # a progress bar
)


def console_noise(output: str) -> list[str]:
    """The lines of `output` (a command's stdout and stderr) that only --verbose may show."""
    lines = (_ANSI.sub("", line) for line in output.splitlines())
    return [line for line in lines if any(pattern.search(line) for pattern in NOISE)]
