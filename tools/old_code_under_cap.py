"""Run an earlier commit's pipeline command on a memory-capped node: the check that a cap which the
current code trains under really binds for the code it replaced (root; cgroup v1, as
`nox -s faults`, or `memory_cap` alone).

    python tools/old_code_under_cap.py --commit 9abfd0d^ --cap-mb 3175 -- \\
        python -m hf_finetune train --data-dir DATA --storage-path RUNS --storage-is-shared ...

The commit is checked out in a temporary git worktree; every process started from here on (the
capped node's raylet and workers, the driver) imports that commit's pipelines and common package
first (PYTHONPATH), while Ray and the libraries stay the installed ones. Prepare the data first,
with the current code or the old one. Printed: the exit code, the OOM kills, the most memory the
node held (anonymous and shared) and its largest processes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from raytrain_testkit.multinode import Driver, capped_node

ROOT = Path(__file__).resolve().parents[1]


def old_code_path(worktree: Path) -> str:
    """The worktree's pipelines and common package, ahead of the installed (editable) ones."""
    sources = [*sorted(worktree.glob("pipelines/*/src")), worktree / "packages" / "common" / "src"]
    return os.pathsep.join(str(source) for source in sources)


def run_capped(command: list[str], cap_mb: int, log_file: Path, timeout_s: float) -> str:
    with capped_node(cap_mb) as (address, cap):
        with cap.sampling_held() as held:
            code = Driver(command, address, log_file).wait(timeout_s=timeout_s)
        return (  # inside: the cap's kill count goes with its group
            f"exit {code}, OOM kills {cap.oom_kills}, the node held at most {held.peak_mb:.0f} "
            f"MiB under a {cap_mb} MiB cap; largest: {held.largest()}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--cap-mb", type=int, required=True, help="the node's memory cap, MiB")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--log", type=Path, default=Path("old_code_under_cap.log"))
    parser.add_argument("command", nargs="+", help="the pipeline command, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="old-code-") as folder:
        worktree = Path(folder) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.commit],
            check=True,
        )
        try:
            os.environ["PYTHONPATH"] = old_code_path(worktree)
            print(
                f"{args.commit}: {run_capped(args.command, args.cap_mb, args.log, args.timeout_s)}"
            )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)],
                check=False,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
