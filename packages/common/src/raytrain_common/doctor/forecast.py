"""The memory forecast of one training worker, for the run's shape, against the GPU's memory or
--memory-limit-gb; when it does not fit, the knobs that do."""

from __future__ import annotations

import os
from typing import Any

from raytrain_common.doctor.report import (
    FAIL,
    OK,
    WARN,
    GiB,
    Report,
)


def check_forecast(
    report: Report,
    profile: Any,
    config: Any,
    facts: dict[str, dict[str, Any]],
    limit_gb: float | None,
) -> None:
    from raytrain_common.memory_forecast import fitting_knobs, forecast

    shape = report.shape
    try:
        step = profile.training_step(config)
        result = forecast(step)
    except Exception as error:
        report.add(
            "memory forecast",
            "worker",
            WARN,
            f"not forecast: {type(error).__name__}: {error}"[:300],
            "the model could not be built for the forecast; the run itself may still work",
        )
        return
    if limit_gb is not None:
        limit, against = int(limit_gb * GiB), f"the stated limit of {limit_gb:g} GiB"
    elif shape.use_gpu:
        gpus = [gpu["memory"] for f in facts.values() for gpu in f.get("gpus", [])]
        if not gpus:
            report.add(
                "memory forecast",
                "worker",
                WARN,
                result.describe() + "; no GPU seen to compare with",
                "pass --memory-limit-gb with the GPUs' memory",
            )
            return
        limit, against = min(gpus), f"the smallest GPU's {min(gpus) / GiB:.1f} GiB"
    else:
        per_node = [
            f["memory_available"] / max(1, min(shape.num_workers, os.cpu_count() or 1))
            for f in facts.values()
        ]
        limit, against = int(min(per_node)), "a worker's share of the node's available memory"
    value = f"{result.describe()}; {against}" + (
        f" ({step.description})" if step.description else ""
    )
    if result.total_bytes <= limit:
        report.add("memory forecast", "worker", OK, value)
        return
    knobs = fitting_knobs(
        step, result, limit, fsdp=profile.fsdp, deepspeed=profile.deepspeed, on_gpu=shape.use_gpu
    )
    report.add(
        "memory forecast",
        "worker",
        FAIL,
        value,
        "does not fit; any one of: " + "; ".join(knobs),
    )
