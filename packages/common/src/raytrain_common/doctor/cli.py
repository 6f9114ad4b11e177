"""`raytrain-doctor`: the command line, the order of the checks and the printed table."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from raytrain_common.doctor.checks import (
    check_auth,
    check_imports,
    check_launcher_variables,
    check_system,
    check_versions,
)
from raytrain_common.doctor.cluster import (
    alive_nodes,
    check_collective,
    check_resources,
    check_storage,
    probe_nodes,
)
from raytrain_common.doctor.forecast import check_forecast
from raytrain_common.doctor.probes import dashboard_address, probe_node
from raytrain_common.doctor.report import (
    COMMON_DISTRIBUTION,
    FAIL,
    OK,
    WARN,
    Report,
    Shape,
    bundle_text,
    is_local_path,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raytrain-doctor",
        description=(
            "Check the Ray cluster at RAY_ADDRESS (or a new local one) for a run: versions and "
            "imports on every node, resources, a timed collective of the run's shape, the storage "
            "path from every node, /dev/shm, disks, memory, and a memory forecast of the model. "
            "Exit status 0 only when nothing FAILs."
        ),
        epilog=(
            "With --pipeline, the shape comes from that pipeline's train flags given after `--`, "
            "e.g. `raytrain-doctor --pipeline NAME -- --preset gpu --num-workers 8`; the "
            "options here override them."
        ),
    )
    add_shape_options(parser)
    parser.add_argument(
        "--require-module",
        action="append",
        default=[],
        help="Also import this module on every node (repeatable).",
    )
    parser.add_argument(
        "--collective-timeout-s",
        type=float,
        default=60.0,
        help="Seconds the collective may take before it counts as hung (60).",
    )
    parser.add_argument(
        "--collective-mb", type=int, help="All-reduce payload for the bandwidth (MiB)."
    )
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument(
        "--memory-limit-gb",
        type=float,
        help="Compare the forecast with this many GiB per worker (default: the GPU's).",
    )
    parser.add_argument(
        "--autoscaling",
        action="store_true",
        help="The cluster adds nodes on demand: missing resources are a WARN.",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="Also write the table as JSON (- for stdout)."
    )
    parser.add_argument(
        "train_args", nargs=argparse.REMAINDER, help="-- then the pipeline's train flags."
    )
    return parser


def add_shape_options(parser: argparse.ArgumentParser) -> None:
    """The run's shape and storage: taken from --pipeline's train flags, or given here."""
    parser.add_argument(
        "--pipeline", help="Take the run's shape, imports and model from this pipeline."
    )
    parser.add_argument("--num-workers", type=int, help="Training workers (default 2).")
    parser.add_argument("--cpus-per-worker", type=float, help="CPUs per worker (default 1).")
    parser.add_argument("--gpus-per-worker", type=float, help="GPUs per worker (default 0: CPU).")
    parser.add_argument(
        "--placement-strategy", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
    )
    parser.add_argument("--storage-path", help="The run's storage path (default ./runs).")
    parser.add_argument(
        "--storage-is-shared",
        action="store_true",
        default=None,
        help="A local-looking path is a shared mount of a kind not recognised (as train's flag).",
    )


def shape_from(args: argparse.Namespace, config: Any | None) -> Shape:
    shape = Shape()
    if config is not None:
        shape = Shape(
            num_workers=config.num_workers,
            cpus_per_worker=config.cpus_per_worker,
            gpus_per_worker=config.gpus_per_worker if config.use_gpu else 0.0,
            placement_strategy=config.placement_strategy,
            accelerator_type=config.accelerator_type,
            storage_path=config.storage_path,
            storage_is_shared=config.storage_is_shared,
        )
    for name in (
        "num_workers",
        "cpus_per_worker",
        "gpus_per_worker",
        "placement_strategy",
        "storage_path",
        "storage_is_shared",
    ):
        value = getattr(args, name)
        if value is not None:
            setattr(shape, name, value)
    if is_local_path(shape.storage_path):
        shape.storage_path = os.path.abspath(shape.storage_path.removeprefix("file://"))
    return shape


def run_checks(args: argparse.Namespace) -> Report:
    import ray

    from raytrain_common.pipeline_profiles import load_profile
    from raytrain_common.ray_start import init_ray, quiet_ray_output

    profile = load_profile(args.pipeline) if args.pipeline else None
    train_args = [a for a in args.train_args if a != "--"]
    config = profile.train_config(train_args) if profile else None
    report = Report(shape_from(args, config))
    shape = report.shape
    distributions = [COMMON_DISTRIBUTION] + ([profile.distribution] if profile else [])
    modules = [*(profile.worker_imports if profile else ()), *args.require_module]

    init_ray(train_cpus=shape.num_workers * shape.cpus_per_worker)
    quiet_ray_output(verbose=False)
    nodes = alive_nodes()
    driver = probe_node(distributions, [], [])
    facts = probe_nodes(report, nodes, distributions, modules)
    check_versions(report, facts, driver)
    check_imports(report, facts, modules)
    check_resources(report, nodes, args.autoscaling)
    check_auth(report, facts, dashboard_address())
    check_launcher_variables(report, facts, driver)
    check_system(report, facts)
    check_storage(report, nodes)
    if not any(row.check == "resources" and row.status == FAIL for row in report.rows):
        check_collective(report, args.collective_timeout_s, args.collective_mb, args.backend)
    if profile is not None:
        check_forecast(report, profile, config, facts, args.memory_limit_gb)
    ray.shutdown()
    return report


def print_table(report: Report, seconds: float, out: Any = sys.stdout) -> None:
    shape = report.shape
    out.write(
        f"raytrain-doctor: {shape.num_workers} worker(s) of {bundle_text(shape.bundle())}, "
        f"storage {shape.storage_path}\n"
    )
    widths = [
        max(len(getattr(row, key)) for row in report.rows) for key in ("check", "node", "status")
    ]
    titles = ("CHECK", "NODE", "STATUS")
    widths = [max(width, len(title)) for width, title in zip(widths, titles, strict=True)]
    out.write("  ".join(t.ljust(w) for t, w in zip(titles, widths, strict=True)) + "  VALUE\n")
    for row in report.rows:
        cells = (row.check, row.node, row.status)
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
        out.write(f"{line}  {row.value}\n")
        if row.fix:
            out.write(" " * (widths[0] + 2) + "fix: " + row.fix + "\n")
    counts = report.counts()
    verdict = "FAIL" if report.failed else "OK"
    out.write(
        f"{verdict}: {counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL in {seconds:.0f} s\n"
    )
    out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    from raytrain_common.configs import ConfigError

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    args = build_parser().parse_args(argv)
    start = time.monotonic()
    try:
        report = run_checks(args)
    except ConfigError as error:
        print(f"raytrain-doctor: error: {error}", file=sys.stderr)
        return 2
    seconds = time.monotonic() - start
    print_table(report, seconds)
    if args.json:
        document = {
            "ok": not report.failed,
            "seconds": round(seconds, 1),
            "shape": asdict(report.shape),
            "rows": [asdict(row) for row in report.rows],
        }
        text = json.dumps(document, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            temporary = f"{args.json}.tmp-{os.getpid()}"
            with open(temporary, "w", encoding="utf-8") as stream:
                stream.write(text)
            os.replace(temporary, args.json)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
