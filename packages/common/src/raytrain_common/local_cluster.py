"""A Ray cluster that stays up between runs, and stopping it (and no other):
`python -m raytrain_common.local_cluster start DIR` / `stop DIR`.

A command run with the variables `start` prints attaches to that cluster instead of starting its
own: a rerun after an edit skips the cluster's start (an edit-run loop of seconds, `nox -s
cluster`). The cluster has token authentication, as every cluster of ours does: its token is a file
in DIR that only its owner reads.

`ray stop` (with or without --force) ends every Ray process of the user on the machine: another
person's training run, a test's cluster, a notebook's. A cluster started with
`ray start --head --temp-dir DIR` (and nodes joined with the same --temp-dir) is found instead by
its own processes: those whose command line names DIR (GCS, raylet, dashboard, monitors), the Ray
Client server (`ray start` starts it and exits, so it has no parent of the cluster's and names only
the GCS's address: `--address=` one of the `--gcs-address=`s of the others), and every process
they started (workers, agents, job drivers), which carry only `ray::…` titles.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path


def cluster_processes(temp_dir: str | Path) -> list:
    """The processes of the cluster whose --temp-dir is `temp_dir`: its daemons and their
    descendants."""
    import psutil

    marker = str(Path(temp_dir).resolve())
    spared = {psutil.Process().pid, *(p.pid for p in psutil.Process().parents())}
    ray_programs = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            cmdline = process.info["cmdline"]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if process.pid not in spared and _is_ray_program(cmdline):
            ray_programs.append((process, cmdline))
    named = [
        (process, cmdline) for process, cmdline in ray_programs if _names_folder(cmdline, marker)
    ]
    gcs = {value for _, cmdline in named for value in _flag_values(cmdline, "--gcs-address")}
    client_servers = [
        process
        for process, cmdline in ray_programs
        if gcs & set(_flag_values(cmdline, "--address"))
    ]
    roots = [process for process, _ in named] + client_servers
    found = {process.pid: process for process in roots}
    for root in roots:
        try:
            found.update({child.pid: child for child in root.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def _is_ray_program(cmdline: list[str] | None) -> bool:
    """A program of Ray's own (under its package, or its `-m ray.…` modules): not a shell or an
    editor whose command line merely mentions the folder, nor this process."""
    if not cmdline:
        return False
    program = " ".join(cmdline[:3])
    return f"{os.sep}ray{os.sep}" in program or " -m ray." in program


def _names_folder(cmdline: list[str], marker: str) -> bool:
    """A flag's value is `marker` or a path inside it."""
    inside = re.compile(re.escape(marker) + r"(/|$)")  # /tmp/ray names no file of /tmp/ray2
    return any(part.startswith("--") and inside.search(part) for part in cmdline[1:])


def _flag_values(cmdline: list[str], flag: str) -> list[str]:
    """The values of `flag` given as `flag=value`."""
    return [part.split("=", 1)[1] for part in cmdline[1:] if part.startswith(f"{flag}=")]


def stop(temp_dir: str | Path, timeout_s: float = 5.0) -> int:
    """SIGTERM the cluster's processes, SIGKILL what is left after `timeout_s`; how many ended.

    Waiting longer buys nothing: measured on Ray 2.60, every process but two ends within 2 s of
    SIGTERM, the raylet after ~12 s and the GCS server not within 20 s, and a cluster without
    external Redis keeps no state that a SIGKILL could lose.
    """
    import psutil

    processes = cluster_processes(temp_dir)
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=timeout_s)
    return len(processes)


def start(temp_dir: str | Path, port: int = 6390) -> dict[str, str]:
    """Start a one-node cluster in `temp_dir` sized as a command's own local cluster would be (the
    cores plus Ray Data's slots), with the commands' environment; return the variables a shell
    exports to attach to it."""
    import math
    import secrets
    import shutil
    import subprocess

    import ray.util

    from raytrain_common.ray_start import DATA_CPUS, RUN_ENV

    folder = Path(temp_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    token = folder / "token"
    if not token.exists():
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32))
    attach = {
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    # Its dashboard and Ray Client server beside its GCS port, not on Ray's 8265 and 10001, which
    # a command's own local cluster takes.
    command = [ray_cli, "start", "--head", f"--port={port}", f"--dashboard-port={port + 1}"]
    command += [f"--ray-client-server-port={port + 2}", f"--temp-dir={folder}"]
    command.append(f"--num-cpus={math.ceil((os.cpu_count() or 1) + DATA_CPUS)}")
    # Its processes know their own cluster's address (see ray_start.own_address_for_its_processes).
    own = {"RAY_ADDRESS": f"{ray.util.get_node_ip_address()}:{port}"}
    environment = {
        **os.environ,
        **RUN_ENV,
        **attach,
        **own,
        "RAY_prestart_worker_first_driver": "0",
    }
    subprocess.run(command, env=environment, check=True, stdout=subprocess.DEVNULL)
    return attach


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raytrain_common.local_cluster",
        description="Start a cluster that commands attach to; stop only the Ray cluster started "
        "with --temp-dir DIR (ray stop stops all).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    starting = commands.add_parser(
        "start", help="a one-node cluster in DIR that commands attach to"
    )
    starting.add_argument("temp_dir", help="its folder: Ray's logs and sockets, its token")
    starting.add_argument(
        "--port",
        type=int,
        default=6390,
        help="the head's GCS port (its dashboard's and client server's: the next two)",
    )
    stopping = commands.add_parser("stop", help="end the processes of the cluster of DIR")
    stopping.add_argument("temp_dir", help="the --temp-dir the cluster's nodes were started with")
    args = parser.parse_args(argv)
    if args.command == "start":
        attach = start(args.temp_dir, args.port)
        print("\n".join(f"export {name}={value}" for name, value in attach.items()))
        print(f"# stop it: python -m raytrain_common.local_cluster stop {args.temp_dir}")
        return 0
    if not Path(args.temp_dir).is_dir():
        print(f"{args.temp_dir}: no such folder (the cluster's --temp-dir)", file=sys.stderr)
        return 2
    ended = stop(args.temp_dir)
    print(f"stopped {ended} process(es) of the Ray cluster in {args.temp_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
