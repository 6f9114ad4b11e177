"""`raytrain-doctor`: check a Ray cluster for a run before the run, in about half a minute.

Every check is done for real on the cluster at RAY_ADDRESS (or a local one): a task pinned to each
node reports its versions, imports, /dev/shm, disks and memory; the storage path is written from
every node, read back from another, listed and deleted; a worker group of the run's shape runs a
timed all-reduce (gloo on CPUs, NCCL on GPUs); and the pipeline's model is forecast at the run's
micro-batch. Each row is OK, WARN or FAIL with what was measured, and every row that is not OK says
what to change. The exit status is 0 only when nothing FAILs; `--json FILE` writes the table for
machines.

The package: `report.py` (the table), `probes.py` (what runs on each node), `checks.py` (pure
checks from facts to rows), `cluster.py` (the checks that act on the cluster), `forecast.py` (the
memory forecast), `cli.py` (the command).
"""

from raytrain_common.doctor.checks import check_auth, check_launcher_variables, check_system
from raytrain_common.doctor.cli import main
from raytrain_common.doctor.report import FAIL, OK, WARN, Report, Row, Shape

__all__ = [
    "FAIL",
    "OK",
    "WARN",
    "Report",
    "Row",
    "Shape",
    "check_auth",
    "check_launcher_variables",
    "check_system",
    "main",
]
