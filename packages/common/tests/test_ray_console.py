"""What reaches a command's console from Ray's other processes (no cluster needed: the filter is fed
the line batches Ray's log streamer hands it)."""

from __future__ import annotations

import io
import logging
from typing import Any

import ray.exceptions

from raytrain_common.ray_start import _without_harmless_lines


def controller_warning() -> list[str]:
    """The lines Ray Train's controller writes when its autoscaling coordinator does not answer in
    time: its own warning text, logged with the real exception's traceback."""
    stream = io.StringIO()
    logger = logging.getLogger("controller-under-test")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        try:
            raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")
        except Exception:
            logger.warning(
                "Failed to send resource request for abc123. If this only happens transiently "
                "during network partition or CPU being overloaded, it's safe to ignore this error."
                " If this error persists, file a GitHub issue.",
                exc_info=True,
            )
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().splitlines()


def test_the_controllers_safe_to_ignore_timeout_is_one_line_and_other_lines_pass() -> None:
    printed: list[dict[str, Any]] = []
    streamed = _without_harmless_lines(printed.append)
    warning = controller_warning()
    assert len(warning) > 4 and warning[1].startswith("Traceback")
    streamed({"pid": 7, "lines": ["epoch 1 starts", *warning[:3]]})
    streamed({"pid": 7, "lines": [*warning[3:], "step 10/40  loss 1.2"]})  # cut across batches
    streamed({"pid": 8, "lines": ["ValueError: a real failure of another process"]})
    lines = [line for batch in printed for line in batch["lines"]]
    assert lines[0] == "epoch 1 starts"
    assert lines[1].startswith("Ray Train's autoscaling request timed out") and "log" in lines[1]
    assert lines[2:] == ["step 10/40  loss 1.2", "ValueError: a real failure of another process"]
