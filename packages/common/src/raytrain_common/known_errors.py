"""The failures that cost users hours, recognised in a failed run's error and named with their fix.

Ray Train hands the driver a worker's failure as an exception whose text holds the worker's own
traceback, often under several layers of Ray's wrapping; the cause is in there, but rarely on the
last line a user reads. `explain` searches the whole chain and returns one line: the cause and what
to change. The pipelines print it under the real traceback; `raytrain-doctor` finds most of these
causes before a run starts.

The patterns come from the errors these failures really print (PyTorch, NCCL, gloo, Ray, pyarrow,
the kernel), most specific first: the first match wins.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass

DOCTOR = "raytrain-doctor"


@dataclass(frozen=True)
class KnownError:
    name: str
    pattern: re.Pattern[str]
    cause: str
    fix: str

    def line(self) -> str:
        return f"known failure ({self.name}): {self.cause}. Fix: {self.fix}"


def _known(name: str, pattern: str, cause: str, fix: str) -> KnownError:
    return KnownError(name, re.compile(pattern, re.IGNORECASE | re.MULTILINE), cause, fix)


KNOWN_ERRORS: tuple[KnownError, ...] = (
    _known(
        "Ray authentication",
        r"InvalidAuthToken|Authentication token is missing or incorrect"
        r"|Unauthorized: Missing authentication token|ray\.exceptions\.AuthenticationError",
        "the Ray cluster requires token authentication, "
        "and this process had no token or another one",
        "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token (or RAY_AUTH_TOKEN_PATH "
        "to a file holding it), the same on every node and client; on KubeRay the operator's "
        "Secret holds it (`kubectl get secret <cluster>` or authOptions.secretName), and a "
        "RayJob's own submitter and pods get it without a change",
    ),
    _known(
        "out of memory under DeepSpeed",
        # A DeepSpeed engine's frames above the OOM (or DeepSpeed's own words for it).
        r"deepspeed[\s\S]*(CUDA out of memory|torch\.OutOfMemoryError)"
        r"|(CUDA out of memory|torch\.OutOfMemoryError)[\s\S]*deepspeed",
        "a GPU ran out of memory in a DeepSpeed ZeRO run",
        "shard more before batching less, in DeepSpeed's order: --deepspeed zero2, zero2 with "
        "--offload optimizer (its state in host memory), zero3 (parameters sharded too), zero3 "
        "with --offload optimizer, then --offload optimizer+params; "
        "or halve the micro-batch and keep the global batch with --grad-accum-steps ×2; "
        f"`{DOCTOR} --pipeline <name> -- <train flags>` forecasts the memory",
    ),
    _known(
        "ZeRO checkpoint of another worker count",
        r"The checkpoint being loaded used a DP world size of \d+ but the current world size is",
        "a DeepSpeed ZeRO checkpoint was loaded by another number of workers than wrote it: its "
        "optimiser state is split per worker",
        "resume with the worker count that wrote it (--num-workers, the first number in the "
        "message); or convert it with DeepSpeed's ds_to_universal; or export its weights (`<pipeline> "
        "export`) and start a new run from them (`zero.check_resume` refuses such a resume before it starts)",
    ),
    _known(
        "GPU index out of range",
        r"invalid device ordinal|Invalid device id|local_rank.*(out of range|exceeds)",
        "a process was told to use a GPU it cannot see: a LOCAL_RANK or device index at or beyond "
        "the GPUs visible to it (CUDA_VISIBLE_DEVICES or LOCAL_RANK set by hand or by a launcher "
        "such as deepspeed or torchrun, or --gpus-per-worker above what a node has)",
        "leave CUDA_VISIBLE_DEVICES and LOCAL_RANK to Ray Train, which gives each worker its GPUs "
        "and sets LOCAL_RANK: unset them in the job's environment and start the command once, "
        f"without a launcher; `{DOCTOR}` lists such variables per node",
    ),
    _known(
        "rendezvous mismatch",
        r"environment variable (MASTER_ADDR|MASTER_PORT|RANK|WORLD_SIZE) expected"
        r"|while trying to connect to \(|DistStoreError|waiting for clients",
        "the processes did not meet at one rendezvous: they were given different MASTER_ADDR / "
        "MASTER_PORT (set by hand, or left by a launcher such as deepspeed or torchrun), or "
        "nothing listens there",
        "leave MASTER_ADDR and MASTER_PORT to Ray Train, which sets them for every worker: unset "
        "them in the job's environment and runtime_env, start the command once without a "
        f"launcher, and allow TCP between the nodes; `{DOCTOR}` lists such variables per node",
    ),
    _known(
        "GPU out of memory",
        r"CUDA out of memory|torch\.OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED"
        r"|HIP out of memory|CUDA error: out of memory",
        "a GPU ran out of memory",
        "halve the micro-batch and keep the global batch with --grad-accum-steps "
        "×2, turn on --activation-checkpointing where the pipeline has it, or "
        f"spread the model over more GPUs (FSDP, --num-workers); `{DOCTOR} "
        "--pipeline <name> -- <train flags>` forecasts the memory",
    ),
    _known(
        "process or thread limit",
        r"can't start new thread|Resource temporarily unavailable|pthread_create failed",
        "a process could not start a thread or a process: the user's limit on processes and "
        "threads (RLIMIT_NPROC, `ulimit -u`, counted over every container of the same uid) or "
        "the pod's pids limit is reached; Ray starts dozens of threads per process",
        "raise the limit (`ulimit -u`, podman/docker `--ulimit nproc=…`, the kubelet's "
        "podPidsLimit), or run fewer workers per node",
    ),
    _known(
        "node out of memory",
        r"killed due to the node running low on memory|ray\.exceptions\.OutOfMemoryError"
        # Not Ray's list of "common causes" that every dead worker's message carries.
        r"|(?<!the process was )killed by (the )?OOM killer|oom[-_ ]kill"
        r"|Memory on the node .* was .* when",
        "a worker was killed because its node ran out of host memory (Ray's memory monitor or "
        "the kernel's OOM killer)",
        "give each worker more memory (fewer workers or --cpus-per-worker higher per node, a "
        "larger pod memory limit), or lower what a worker holds: a smaller batch, or a smaller "
        "training split (workers that read their split into memory hold all of it)",
    ),
    _known(
        "shared memory too small",
        r"/dev/shm|shm_open|Error while creating shared memory segment|unable to (allocate|write "
        r"to) shared memory|NCCL WARN .*shm",
        "/dev/shm is too small (containers get 64 MiB by "
        "default); NCCL and DataLoader workers need it",
        "mount a memory-backed emptyDir at /dev/shm (the manifests in deploy/rayjob do) or run "
        "docker with --shm-size=8g",
    ),
    _known(
        "collective timeout",
        r"Watchdog caught collective operation timeout|ProcessGroupNCCL.*[Tt]imeout"
        r"|DistNetworkError|Connection closed by peer|Connection reset by peer"
        r"|Socket Timeout|timed out .*(rendezvous|store|barrier)|(gloo|store).*timed out"
        r"|NCCL (WARN|error).*(Connect|socket|Net)|ncclSystemError|ncclRemoteError",
        "a collective between workers did not complete: ranks cannot reach each other (closed "
        "ports, the wrong network interface, InfiniBand not set up) or one rank is stuck",
        "allow all TCP ports between the nodes, set NCCL_SOCKET_IFNAME / "
        "GLOO_SOCKET_IFNAME to the interface the nodes share (e.g. eth0), check "
        "InfiniBand with NCCL_DEBUG=INFO (NCCL_IB_HCA, or NCCL_IB_DISABLE=1 "
        f"without it); `{DOCTOR}` runs a timed collective of the run's shape",
    ),
    _known(
        "NCCL error",
        r"NCCL error|ncclInternalError|ncclUnhandledCudaError|ncclInvalidUsage",
        "NCCL failed between the GPUs",
        "rerun with NCCL_DEBUG=INFO to see the failing transport; make the CUDA driver, torch and "
        f"NCCL the same on every node (`{DOCTOR}` compares them)",
    ),
    _known(
        "port in use",
        r"Address already in use|EADDRINUSE|errno:? 98\b",
        "a port the run binds is already taken (a leftover `ray start`, another training job on "
        "the node, or a fixed MASTER_PORT used twice)",
        "stop the other process (a leftover local cluster: `python -m "
        "raytrain_common.local_cluster "
        "stop <its --temp-dir>`, which ends that cluster only) or unset MASTER_PORT and let Ray "
        "Train pick a free one",
    ),
    _known(
        "missing module on a worker",
        r"(ModuleNotFoundError|ImportError): No module named '?([\w.]+)'?",
        "a worker process cannot import a module the run needs: "
        "its image or environment differs from the driver's",
        "install the package in the image every node runs (deploy/Dockerfile) "
        f"or add it to the job's runtime_env pip list; `{DOCTOR} --pipeline "
        "<name>` imports the pipeline's modules on every node",
    ),
    _known(
        "version mismatch",
        r"Version mismatch|was started with .* but this process .* with"
        r"|Python version .* does not match",
        "the nodes run different Ray or Python versions",
        f"run one image on every node of the cluster (`{DOCTOR}` lists the versions per node)",
    ),
    _known(
        "storage error",
        r"AWS Error|NoSuchBucket|AccessDenied|ExpiredToken|InvalidAccessKeyId|SignatureDoesNotMatch"
        r"|google\.auth|GCS .*(403|401)|Permission denied: '?/mnt|Read-only file system"
        r"|Stale file handle|Transport endpoint is not connected",
        "the storage path cannot be written or read (credentials, bucket, permissions, or an NFS "
        "mount that went away)",
        "check the credentials in every pod's environment and the path with "
        f"`{DOCTOR} --storage-path <path>` (it writes and reads from every node); "
        "--storage-patience-s sets how long uploads retry through an outage",
    ),
    _known(
        "disk full",
        r"No space left on device|ENOSPC|Disk quota exceeded",
        "a disk filled up (the storage path, /tmp where "
        "Ray spills objects, or a checkpoint folder)",
        "free space or point --storage-path at a larger volume; keep fewer checkpoints "
        "(--num-to-keep); Ray's spill folder is under RAY_TMPDIR (/tmp/ray)",
    ),
    _known(
        "non-finite loss",
        r"FloatingPointError|loss is (nan|inf|-inf)\b",
        "the training loss became NaN or infinite",
        "lower --lr (or lengthen the warm-up), set --grad-clip-norm, use bf16 rather than fp16, "
        "and check the data for empty or mislabelled rows",
    ),
)


def error_text(error: BaseException) -> str:
    """The whole chain, tracebacks included: Ray puts the worker's traceback in the message text."""
    return "".join(traceback.format_exception(error))


def match(text: str) -> KnownError | None:
    return next((known for known in KNOWN_ERRORS if known.pattern.search(text)), None)


def explain(error: BaseException | str) -> str | None:
    """One line naming the cause and the fix of a known failure, or None for anything else."""
    text = error if isinstance(error, str) else error_text(error)
    known = match(text)
    if known is None:
        return None
    line = known.line()
    if known.name == "missing module on a worker":
        missing = re.search(r"No module named '?([\w.]+)'?", text)
        if missing:
            line = line.replace("a module the run needs", f"module '{missing.group(1)}'")
    return line
