"""The checks that act on the cluster: probing every node, the storage path written from every
node and read from another, a worker group's collective, the memory forecast."""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

from raytrain_common.doctor.probes import CollectiveRank, probe_node, storage_round
from raytrain_common.doctor.report import (
    COLLECTIVE_CAUSES,
    FAIL,
    OK,
    PROBE_TIMEOUT_S,
    WARN,
    Report,
    bundle_text,
    is_local_path,
    short,
)


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [node for node in ray.nodes() if node.get("Alive")]


def on_node(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def probe_nodes(
    report: Report,
    nodes: list[dict[str, Any]],
    distributions: Sequence[str],
    modules: Sequence[str],
) -> dict[str, dict[str, Any]]:
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(probe_node)
    paths = [report.shape.storage_path] if is_local_path(report.shape.storage_path) else []
    pending = {
        node["NodeID"]: task.options(scheduling_strategy=on_node(node["NodeID"])).remote(
            list(distributions), list(modules), paths
        )
        for node in nodes
    }
    facts: dict[str, dict[str, Any]] = {}
    stores = {
        node["NodeID"]: node.get("Resources", {}).get("object_store_memory") for node in nodes
    }
    for node_id, ref in pending.items():
        try:
            facts[node_id] = ray.get(ref, timeout=PROBE_TIMEOUT_S)
            facts[node_id]["object_store_memory"] = stores[node_id]
        except Exception as error:
            report.add(
                "node answers",
                short(node_id),
                FAIL,
                f"{type(error).__name__}: {error}"[:300],
                "the node is listed alive but runs no task: check its raylet log "
                "(/tmp/ray/session_latest/logs/raylet.out on that node) and that it is not out of "
                "memory or disk",
            )
    return facts


def check_storage(report: Report, nodes: list[dict[str, Any]]) -> None:
    """The storage path written from every node, read back from another, listed and deleted; then
    whether the run would refuse it as node-local."""
    from raytrain_common.storage import StorageError, check_shared_for_cluster, resolve_storage

    shape = report.shape
    try:
        storage = resolve_storage(shape.storage_path)
    except StorageError as error:
        report.add("storage", "driver", FAIL, str(error), "give --storage-path a valid location")
        return
    node_ids = [node["NodeID"] for node in nodes]
    folder = f".raytrain-doctor-{uuid.uuid4().hex[:8]}"
    written, read = (
        storage_round_on_every_node(storage.uri, folder, node_ids, step)
        for step in ("write", "read")
    )
    storage_round_on_every_node(storage.uri, folder, node_ids, "delete")
    with contextlib.suppress(OSError):  # already gone, or a bucket where folders are prefixes
        storage.join(folder).filesystem.delete_dir(storage.join(folder).path)
    all_shared = add_storage_rows(report, storage.uri, node_ids, written, read)
    try:
        check_shared_for_cluster(storage, len(nodes), assume_shared=shape.storage_is_shared)
    except StorageError as error:
        seen = (
            "Every node did see the others' files here: if this is such a mount, "
            "--storage-is-shared is safe."
            if all_shared
            else "The nodes did not see each other's files: the path is node-local."
        )
        problem, fix = str(error).split(": ", 1)
        report.add("storage shared", "cluster", FAIL, problem, f"{fix} {seen}")
        return
    if len(nodes) > 1 and all_shared:
        report.add(
            "storage shared", "cluster", OK, f"every node sees every node's files at {storage.uri}"
        )
    elif len(nodes) == 1:
        report.add("storage shared", "cluster", OK, "one node: nothing to share")


def storage_round_on_every_node(
    uri: str, folder: str, node_ids: list[str], step: str
) -> dict[str, dict[str, Any]]:
    """One step (write, read, delete) of `storage_round`, by a task pinned to each node."""
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(storage_round)
    refs = {
        node_id: task.options(scheduling_strategy=on_node(node_id)).remote(
            uri, folder, node_id, step, node_ids
        )
        for node_id in node_ids
    }
    results = {}
    for node_id, ref in refs.items():
        try:
            results[node_id] = ray.get(ref, timeout=PROBE_TIMEOUT_S)
        except Exception as error:
            results[node_id] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return results


def add_storage_rows(
    report: Report,
    uri: str,
    node_ids: list[str],
    written: dict[str, dict[str, Any]],
    read: dict[str, dict[str, Any]],
) -> bool:
    """A row per node: it wrote, and saw every other node's file; True when every node did."""
    all_shared = True
    for node_id in node_ids:
        node = short(node_id)
        wrote, saw = written[node_id], read[node_id]
        if wrote["error"] or saw["error"]:
            all_shared = False
            report.add(
                "storage",
                node,
                FAIL,
                f"{uri}: {wrote['error'] or saw['error']}",
                "make the path writable from every node: mount the same volume at the same path "
                "on every pod, or give the credentials for the bucket to every pod",
            )
            continue
        missing = sorted(set(node_ids) - set(saw.get("listed", [])))
        neighbour_ok = saw.get("read_ok", True)
        if missing or not neighbour_ok:
            all_shared = False
            report.add(
                "storage",
                node,
                FAIL,
                f"{uri}: wrote its file, but sees no file from node(s) "
                f"{', '.join(map(short, missing)) or short(saw['read_from'])}",
                "this path is not shared: each node writes to its own disk, so checkpoints from "
                "workers on other nodes would be lost. Mount one shared volume (NFS / a "
                "ReadWriteMany PVC) at this path on every node, or use s3://bucket/prefix or "
                "gs://bucket/prefix",
            )
        else:
            read_from = saw.get("read_from")
            also = f", read node {short(read_from)}'s" if read_from else ""
            report.add(
                "storage", node, OK, f"{uri}: wrote{also}, listed {len(saw['listed'])}, deleted"
            )
    return all_shared


def check_collective(report: Report, timeout_s: float, size_mb: int | None, backend: str) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    shape = report.shape
    world = shape.num_workers
    backend = backend if backend != "auto" else ("nccl" if shape.use_gpu else "gloo")
    size_mb = size_mb or (256 if backend == "nccl" else 16)
    group = placed_group(report, timeout_s)
    if group is None:
        return
    rank_class = ray.remote(CollectiveRank)
    ranks = [
        rank_class.options(
            num_cpus=shape.cpus_per_worker,
            num_gpus=shape.gpus_per_worker if shape.use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index
            ),
        ).remote()
        for index in range(world)
    ]
    try:
        host, port = ray.get(ranks[0].address.remote(), timeout=PROBE_TIMEOUT_S)
        nodes = len(set(ray.get([rank.node.remote() for rank in ranks], timeout=PROBE_TIMEOUT_S)))
        start = time.monotonic()
        refs = [
            rank.run.remote(index, world, f"tcp://{host}:{port}", backend, size_mb, timeout_s)
            for index, rank in enumerate(ranks)
        ]
        _, not_ready = ray.wait(refs, num_returns=world, timeout=timeout_s)
        elapsed = time.monotonic() - start
        if not_ready:
            report.add(
                "collective",
                "cluster",
                FAIL,
                f"{backend}, {world} ranks: {len(not_ready)} rank(s) had not finished the "
                f"all-reduce after {timeout_s:g} s (the run would hang, then time out)",
                f"likely causes: {COLLECTIVE_CAUSES}",
            )
            return
        results = ray.get(refs)
    except Exception as error:
        report.add(
            "collective",
            "cluster",
            FAIL,
            f"{backend}: {type(error).__name__}: {error}"[:400],
            f"likely causes: {COLLECTIVE_CAUSES}",
        )
        return
    finally:
        for rank in ranks:
            ray.kill(rank)
        remove_placement_group(group)
    add_collective_row(report, results, backend, nodes, size_mb, elapsed)


def add_collective_row(
    report: Report,
    results: list[dict[str, Any]],
    backend: str,
    nodes: int,
    size_mb: int,
    elapsed: float,
) -> None:
    """The collective's row: FAIL when the ranks disagree, WARN for NCCL on TCP sockets."""
    world = len(results)
    correct = all(result["correct"] for result in results)
    latency = max(result["latency_us"] for result in results)
    bandwidth = min(result["bus_gbps"] for result in results)
    value = (
        f"{backend}, {world} rank(s) on {nodes} node(s): all-reduce "
        f"{'correct' if correct else 'WRONG'}, latency {latency:.0f} µs, bus bandwidth "
        f"{bandwidth:.2f} GB/s ({size_mb} MiB), in {elapsed:.1f} s"
    )
    if not correct:
        report.add(
            "collective",
            "cluster",
            FAIL,
            value,
            "the ranks disagree on a sum: mixed NCCL/CUDA versions or a faulty GPU or link; "
            "compare the versions rows and run NCCL's all_reduce_perf on the nodes",
        )
    elif backend == "nccl" and world > 1 and bandwidth < 1.0:
        report.add(
            "collective",
            "cluster",
            WARN,
            value,
            "NCCL is slower than 1 GB/s, i.e. on TCP sockets: check InfiniBand / EFA with "
            "NCCL_DEBUG=INFO (NCCL_IB_HCA, the EFA plugin) and NCCL_SOCKET_IFNAME",
        )
    else:
        report.add("collective", "cluster", OK, value)


def placed_group(report: Report, timeout_s: float) -> Any:
    """The run's worker group as a placement group, once placed; None (and a FAIL row) when the
    cluster cannot place it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    shape = report.shape
    world = shape.num_workers
    group = placement_group([shape.bundle()] * world, strategy=shape.placement_strategy)
    try:
        ray.get(group.ready(), timeout=min(60.0, max(10.0, timeout_s)))
    except Exception:
        remove_placement_group(group)
        report.add(
            "collective",
            "cluster",
            FAIL,
            f"the {world} worker(s) of {bundle_text(shape.bundle())} "
            f"({shape.placement_strategy}) could not be placed",
            "see the resources rows: the run could not start its worker group either",
        )
        return None
    return group


def check_resources(report: Report, nodes: list[dict[str, Any]], autoscaling: bool) -> None:
    import ray

    shape = report.shape
    bundle = shape.bundle()
    available = ray._private.state.available_resources_per_node()
    fits_total = 0
    for node in nodes:
        node_id = node["NodeID"]
        free = available.get(node_id, {})
        total = node.get("Resources", {})
        fits = min(
            math.floor(free.get(name, 0.0) / amount + 1e-9) for name, amount in bundle.items()
        )
        if shape.accelerator_type and f"accelerator_type:{shape.accelerator_type}" not in total:
            fits = 0
        fits_total += fits
        held = ", ".join(
            f"{name} {free.get(name, 0.0):g}/{total.get(name, 0.0):g} free"
            for name in ("CPU", "GPU")
            if total.get(name) or name in bundle
        )
        report.add(
            "resources",
            short(node_id),
            OK,
            f"{held}: {fits} worker(s) of {bundle_text(bundle)} fit",
        )
    wanted = shape.num_workers
    summary = f"{min(fits_total, wanted)} of {wanted} worker(s) of {bundle_text(bundle)} fit now"
    if shape.accelerator_type:
        summary += f" on {shape.accelerator_type} nodes"
    if fits_total >= wanted:
        report.add("resources", "cluster", OK, summary)
    elif autoscaling:
        report.add(
            "resources",
            "cluster",
            WARN,
            summary + "; the autoscaler must add the rest",
            "make sure the worker group's maxReplicas can hold the run, or lower --num-workers",
        )
    else:
        lower = (
            f"lower --num-workers to {fits_total}" if fits_total else "no node can hold one worker"
        )
        report.add(
            "resources",
            "cluster",
            FAIL,
            summary,
            f"{lower}: ask for fewer CPUs/GPUs per worker, add nodes (worker replicas) with "
            "them, or stop what holds them now (`ray status` lists it); the run would wait for "
            "resources for ever",
        )
