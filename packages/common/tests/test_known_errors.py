"""The known-failure table: real errors of each cause are named with their fix, the cause is found
under Ray's wrapping, and other errors are left alone."""

from __future__ import annotations

import errno
import importlib
import socket

import pytest

from raytrain_common.known_errors import KNOWN_ERRORS, explain


def raised(action: object) -> BaseException:
    try:
        action()  # type: ignore[operator]
    except BaseException as error:
        return error
    raise AssertionError("nothing was raised")


def bind_twice() -> None:
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", 0))
        first.listen()
        second.bind(first.getsockname())


def test_a_port_already_in_use_is_named_with_its_fix() -> None:
    error = raised(bind_twice)
    assert isinstance(error, OSError) and error.errno == errno.EADDRINUSE
    line = explain(error)
    assert line is not None and line.startswith("known failure (port in use)")
    # The command that stops one cluster, not `ray stop`, which ends every Ray cluster of the
    # user's.
    assert "python -m raytrain_common.local_cluster stop" in line and "ray stop" not in line


def test_a_missing_module_names_the_module_and_the_image() -> None:
    line = explain(raised(lambda: importlib.import_module("no_such_module_for_the_table")))
    assert line is not None and "module 'no_such_module_for_the_table'" in line
    assert "deploy/Dockerfile" in line and "runtime_env" in line


def test_a_cause_is_found_under_layers_of_wrapping() -> None:
    """Ray Train gives the driver the worker's traceback as text inside its own exception."""

    def worker() -> None:
        raise FloatingPointError("rank 0: loss is nan at epoch 1 step 3; lower --lr")

    def controller() -> None:
        try:
            worker()
        except FloatingPointError as error:
            raise RuntimeError("Training failed due to worker errors:\n" + repr(error)) from None

    line = explain(raised(controller))
    assert line is not None and line.startswith("known failure (non-finite loss)")
    assert "--grad-clip-norm" in line


@pytest.mark.parametrize(
    ("text", "name"),
    [
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            "GPU out of memory",
        ),
        (
            # DeepSpeed's engine in the traceback: the fix is ZeRO's next stage or offload.
            'File "deepspeed/runtime/zero/stage3.py", line 2210, in step\n'
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB",
            "out of memory under DeepSpeed",
        ),
        (
            # DeepSpeed 0.19.8's own words (runtime/engine.py) loading shards on 1 worker of 2.
            "deepspeed.runtime.zero.utils.ZeRORuntimeException: The checkpoint being loaded used "
            "a DP world size of 2 but the current world size is 1. Automatic adjustment of ZeRO's "
            "optimizer state partitioning with a new world size is not currently supported.",
            "ZeRO checkpoint of another worker count",
        ),
        (
            "torch.AcceleratorError: CUDA error: invalid device ordinal",
            "GPU index out of range",
        ),
        (
            # torch's env:// rendezvous at an address nobody serves (a hand-set MASTER_PORT).
            "torch.distributed.DistNetworkError: The client socket has timed out after 600000ms "
            "while trying to connect to (10.0.0.7, 29501).",
            "rendezvous mismatch",
        ),
        (
            "ValueError: Error initializing torch.distributed using env:// rendezvous: environment "
            "variable MASTER_ADDR expected, but not set",
            "rendezvous mismatch",
        ),
        (
            "ray.exceptions.OutOfMemoryError: Task was "
            "killed due to the node running low on memory.",
            "node out of memory",
        ),
        (
            "Worker exit detail: ... The process is killed by "
            "SIGKILL by OOM killer due to high memory usage",
            "node out of memory",
        ),
        (
            # A uid's process limit reached by Ray's threads in containers (found in
            # tests/test_image.py): Ray's dead-worker message lists the OOM killer among its
            # "common causes", which must not be taken for the cause.
            "Worker exit detail: Worker unexpectedly exits with a connection error code 2. Some "
            "common causes include: (1) the process was killed by the OOM killer due to high "
            'memory usage, (2) ray stop --force was called ...\n  File "ray/_private/state.py",'
            " in _connect_and_get_accessor\nRuntimeError: Resource temporarily unavailable",
            "process or thread limit",
        ),
        (
            "[Rank 1] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)",
            "collective timeout",
        ),
        (
            "torch.distributed.DistNetworkError: The client socket has timed out after 1800s",
            "collective timeout",
        ),
        (
            "NCCL WARN Error: failed to extend /dev/shm/nccl-abc to 9637892 bytes",
            "shared memory too small",
        ),
        (
            "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
            "unhandled system error, ncclInternalError",
            "NCCL error",
        ),
        (
            "OSError: When uploading part for key 'runs/x': AWS Error ACCESS_DENIED during "
            "UploadPart operation",
            "storage error",
        ),
        ("OSError: [Errno 28] No space left on device", "disk full"),
        (
            "RuntimeError: Version mismatch: The cluster was "
            "started with Ray 2.60.0 but this process uses 2.59.0",
            "version mismatch",
        ),
        # What ray.init prints joining a token cluster without the token (Ray 2.60, measured).
        (
            "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token "
            "is missing or incorrect.",
            "Ray authentication",
        ),
        (
            "ConnectionError: Failed to connect to Ray cluster at 10.0.0.5:6379 ... Unauthorized: "
            "Missing authentication token",
            "Ray authentication",
        ),
    ],
)
def test_each_tabulated_message_is_named(text: str, name: str) -> None:
    line = explain(text)
    assert line is not None and line.startswith(f"known failure ({name})"), line
    known = next(k for k in KNOWN_ERRORS if k.name == name)
    assert known.fix in line


def test_an_unknown_error_is_left_alone() -> None:
    assert explain(raised(lambda: {}["missing key"])) is None
    assert explain("ValueError: global_batch_size=7 does not divide evenly") is None


def test_the_authentication_line_names_the_token_variables() -> None:
    line = explain(
        "ray.exceptions.AuthenticationError: Authentication token is missing or incorrect"
    )
    assert line is not None
    for variable in ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        assert variable in line
