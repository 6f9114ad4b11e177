"""What a Ray Train run costs before its training function's first line, with nothing to train.

    nox -s bench_ray_train_floor      (or: python tools/bench_ray_train_floor.py [--runs 3])

The floor under every pipeline's time to its first optimiser step (issue 45 asked for 12 s on
2 cores), counted from the process's start as the pipelines' `startup_s` is: Python and this
process's imports of Ray Train and torch, a local Ray cluster's start as the
pipelines start one, then `TorchTrainer.fit()` on 2 workers whose function only notes the time it
began. No data, no model, no checkpoint: what is left is Ray Train's own start (its controller,
placement group, worker actors and their imports, the process group). The first run is what
`train` pays; later runs on the same cluster show what a warm cluster saves.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def note_start(config: dict[str, str]) -> None:
    """The training function: rank 0 writes the wall-clock time it began, and returns."""
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:
        Path(config["note"]).write_text(json.dumps(time.time()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fit() calls on the same cluster")
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_common.loop import process_started_at
    from raytrain_common.ray_start import init_ray

    imported = time.time()
    init_ray(train_cpus=2)
    started = time.time()
    print(
        f"imports {imported - process_started_at():.1f} s, "
        f"the local cluster's start {started - imported:.1f} s"
    )
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.runs):
            note = Path(scratch) / f"began-{index}.json"
            trainer = TorchTrainer(
                note_start,
                train_loop_config={"note": str(note)},
                scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(name=f"floor-{index}", storage_path=scratch),
            )
            called = time.time()
            trainer.fit()
            ended = time.time()
            began = json.loads(note.read_text()) - called
            print(
                f"run {index + 1}: fit() to the function's first line {began:.1f} s, "
                f"fit() in all {ended - called:.1f} s"
            )
    ray.shutdown()


if __name__ == "__main__":
    main()
