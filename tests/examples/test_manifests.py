"""The manifests under examples/ (examples/reference_worker aside) are what the README says they are.

Without a cluster: every YAML document parses, validates with the pydantic model of its kind and loses
nothing in a round trip through it; identity hash labels are right; checkpointRefs and policy targets
point at objects of the same directory; a pre-warmed checkpoint runs the very worker its users run; an
identity says what the worker's arguments say; policy queries select the pods the controller creates.

Against the real apiserver (the `cluster` marker): every file applies with server-side dry-run (and the
object the apiserver would store still validates and keeps every field), each directory applies as the
README's `kubectl apply -f` does, and broken copies are refused with a message naming the field.

Against a real Prometheus: every policy query parses, returns one total, and counts exactly the worker
pods of its target (not another graph's, not another namespace's).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.api.scalingpolicy import TARGET_PER_REPLICA_MESSAGE
from dynamo_snapshot.autoscale.prometheus import NoData, PrometheusError, PrometheusSource
from dynamo_snapshot.controller.podspec import MAIN_CONTAINER, new_pod_name, pod_name_prefix
from dynamo_snapshot_dev.localcluster import LocalCluster, LocalPrometheus
from tests.api.helpers import MODELS, lost
from tests.helpers.prometheus import local_prometheus
from tests.helpers.stub_server import StubServer
from tests.integration.apply import refused, refused_by_both, server_dry_run

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
README = EXAMPLES / "README.md"
FRAMEWORKS = ("vllm", "sglang", "trtllm")
# The namespace examples/README.md applies the examples to, and the one the policies' queries name.
NAMESPACE = "dynamo-inference"

DGD, CKPT, POLICY = "DynamoGraphDeployment", "DynamoCheckpoint", "DynamoScalingPolicy"
SNAPSHOT_JOB = "SnapshotJob"
# Kubernetes' own kinds an example may hold (the plain Deployment restored through restore-from), as
# `kubectl apply` names them; the apiserver's dry run is their model.
BUILTIN = {("apps/v1", "Deployment"): "deployment.apps", ("v1", "Service"): "service"}
# Directories of the generic layer (a SnapshotJob and a plain Deployment), beside the Dynamo frameworks.
PLAIN = ("plain-vllm",)

# How each framework's Dynamo worker spells the identity's fields on its command line.
FLAGS: dict[str, dict[str, str]] = {
    "vllm": {
        "model": "--model",
        "tensorParallelSize": "--tensor-parallel-size",
        "dtype": "--dtype",
        "maxModelLen": "--max-model-len",
    },
    "sglang": {
        "model": "--model-path",
        "tensorParallelSize": "--tp",
        "dtype": "--dtype",
        "maxModelLen": "--context-length",
    },
    "trtllm": {
        "model": "--model-path",
        "tensorParallelSize": "--tensor-parallel-size",
        "maxModelLen": "--max-seq-len",
    },
}


@pytest.fixture(scope="module")
def crds(crds: list[str], v1alpha1_served: None) -> list[str]:
    """The CRDs with v1alpha1 DGDs served too (the chart's arrangement): this module applies v1alpha1
    manifests. crds/ alone serves v1beta1 only (test_crds_as_shipped.py)."""
    return crds


def _manifest_files() -> list[Path]:
    return sorted(
        path
        for path in EXAMPLES.rglob("*")
        if path.suffix in (".yaml", ".yml")
        and "reference_worker" not in path.relative_to(EXAMPLES).parts
        and path.is_file()
    )


MANIFEST_FILES = _manifest_files()
IDS = [path.relative_to(EXAMPLES).as_posix() for path in MANIFEST_FILES]


def _documents(path: Path) -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]
    assert docs, f"{path} holds no YAML document"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document is not a mapping"
    return docs


def _all(kind: str, directory: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    return [
        (path, doc)
        for path in MANIFEST_FILES
        if directory is None or path.parent == directory
        for doc in _documents(path)
        if doc.get("kind") == kind
    ]


def _checkpointed_services(dgd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in dgd["spec"]["services"].items()
        if (svc.get("checkpoint") or {}).get("enabled")
    }


def _main_container(service: dict[str, Any]) -> dict[str, Any]:
    main: dict[str, Any] = service["extraPodSpec"]["mainContainer"]
    return main


def _checkpoint_container(ckpt: dict[str, Any]) -> dict[str, Any]:
    containers = ckpt["spec"]["job"]["podTemplateSpec"]["spec"]["containers"]
    found = [c for c in containers if c["name"] == MAIN_CONTAINER]
    assert len(found) == 1, f"{ckpt['metadata']['name']}: no single container named {MAIN_CONTAINER!r}"
    main: dict[str, Any] = found[0]
    return main


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


# --- what is there ---------------------------------------------------------------------------------


def test_every_framework_has_auto_checkpoint_ref_prewarm_and_policy() -> None:
    for framework in FRAMEWORKS:
        directory = EXAMPLES / framework
        dgds = [doc for _, doc in _all(DGD, directory)]
        services = [svc for dgd in dgds for svc in _checkpointed_services(dgd).values()]
        ref = [s for s in services if s["checkpoint"].get("checkpointRef")]
        auto = [s for s in services if s not in ref and "identity" in s["checkpoint"]]
        assert auto, f"{framework}: no Auto-mode service"
        assert ref, f"{framework}: no service with checkpointRef"
        assert _all(CKPT, directory), f"{framework}: no pre-warm DynamoCheckpoint"
        assert _all(POLICY, directory), f"{framework}: no DynamoScalingPolicy"
        for _, dgd in _all(DGD, directory):
            assert dgd["spec"].get("backendFramework") == framework


def test_readme_names_every_file() -> None:
    text = README.read_text(encoding="utf-8")
    for rel in IDS:
        assert rel in text, f"examples/README.md does not mention {rel}"
    assert f"-n {NAMESPACE}" in text


def test_readme_links_resolve() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8"))
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local
    for link in local:
        assert (EXAMPLES / link).exists(), f"examples/README.md links to {link}, which does not exist"


# --- models ----------------------------------------------------------------------------------------


def _builtin(doc: dict[str, Any]) -> str | None:
    """How `kubectl apply` names a document of Kubernetes' own kinds; None for ours."""
    return BUILTIN.get((doc.get("apiVersion", ""), doc.get("kind", "")))


@pytest.mark.parametrize("path", MANIFEST_FILES, ids=IDS)
def test_validates_with_its_model_and_loses_nothing(path: Path) -> None:
    for doc in _documents(path):
        if _builtin(doc) is not None:
            assert "namespace" not in doc["metadata"], f"{path}: remove metadata.namespace"
            continue  # Kubernetes' own kinds: the apiserver's dry run below is their model
        assert doc.get("apiVersion") == f"{protocol.API_GROUP}/{protocol.API_VERSION}", path
        assert doc.get("kind") in MODELS, f"{path}: unknown kind {doc.get('kind')!r}"
        # No namespace in the file: `kubectl apply -n NS` puts it anywhere.
        assert "namespace" not in doc["metadata"], f"{path}: remove metadata.namespace"
        model = MODELS[doc["kind"]].model_validate(doc)
        # DynamoScalingPolicy drops keys it does not know: a typo in an example would vanish here.
        assert lost(doc, model.to_dict()) == []


def test_identity_hash_labels_are_the_identity_hashes() -> None:
    checkpoints = _all(CKPT)
    assert checkpoints
    for path, ckpt in checkpoints:
        label = (ckpt["metadata"].get("labels") or {}).get(protocol.LABEL_CHECKPOINT_HASH)
        assert label == compute_identity_hash(ckpt["spec"]["identity"]), path


def test_prewarm_pod_template_is_what_the_agent_needs() -> None:
    for path, ckpt in _all(CKPT):
        template = ckpt["spec"]["job"]["podTemplateSpec"]["spec"]
        assert template.get("restartPolicy") == "Never", path
        main = _checkpoint_container(ckpt)
        env = {e["name"]: e.get("value") for e in main.get("env") or []}
        for name in protocol.ENV_CONTROL_DIRS:
            assert env.get(name) == protocol.CONTROL_MOUNT_PATH, f"{path}: env {name}"
        mounts = {m["name"]: m["mountPath"] for m in main.get("volumeMounts") or []}
        assert mounts.get(protocol.CONTROL_VOLUME_NAME) == protocol.CONTROL_MOUNT_PATH, path
        volumes = {v["name"] for v in template.get("volumes") or []}
        assert protocol.CONTROL_VOLUME_NAME in volumes, path
        assert main["resources"]["limits"][protocol.RESOURCE_GPU], f"{path}: the worker needs a GPU"


def test_checkpoint_refs_name_a_checkpoint_of_the_same_directory() -> None:
    refs = 0
    for path, dgd in _all(DGD):
        names = {c["metadata"]["name"] for _, c in _all(CKPT, path.parent)}
        for svc_name, svc in _checkpointed_services(dgd).items():
            ref = svc["checkpoint"].get("checkpointRef")
            if ref:
                refs += 1
                assert ref in names, f"{path}: {svc_name} names {ref!r}, not one of {sorted(names)}"
    assert refs == len(FRAMEWORKS)


def test_prewarmed_checkpoint_runs_the_worker_its_users_run() -> None:
    """The restored process is the checkpoint's: a user with another image or other arguments would
    silently serve with the checkpoint's. Auto-mode users find it by hash, so they count too."""
    users = 0
    for path, ckpt in _all(CKPT):
        name, ckpt_hash = ckpt["metadata"]["name"], compute_identity_hash(ckpt["spec"]["identity"])
        source = _checkpoint_container(ckpt)
        for _, dgd in _all(DGD, path.parent):
            for svc_name, svc in _checkpointed_services(dgd).items():
                cfg = svc["checkpoint"]
                by_ref = cfg.get("checkpointRef") == name
                by_hash = not cfg.get("checkpointRef") and compute_identity_hash(cfg["identity"]) == ckpt_hash
                if not (by_ref or by_hash):
                    continue
                users += 1
                worker = _main_container(svc)
                for key in ("image", "command", "args", "workingDir"):
                    assert worker.get(key) == source.get(key), f"{dgd['metadata']['name']}/{svc_name}: {key}"
                gpus = source["resources"]["limits"][protocol.RESOURCE_GPU]
                assert svc["resources"]["limits"]["gpu"] == gpus
    assert users == 2 * len(FRAMEWORKS)  # each pre-warm: its checkpointRef user and its Auto user


def _pod_template_container(spec: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    found = [c for c in spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"{where}: no single container named {name!r}"
    container: dict[str, Any] = found[0]
    return container


@pytest.mark.parametrize("directory", PLAIN)
def test_a_plain_deployment_restores_the_snapshot_its_snapshot_job_takes(directory: str) -> None:
    """restore-from names the PodSnapshot the directory's SnapshotJob leaves (it is named after the job), in
    the container that job captures, running the very image and command: a restore brings back the captured
    process, so anything else would silently serve the job's. The snapshot plumbing (control volume,
    standby, affinity, readiness gate) is left to the restore webhook, so none is written by hand."""
    jobs = {doc["metadata"]["name"]: doc for _, doc in _all(SNAPSHOT_JOB, EXAMPLES / directory)}
    deployments = [doc for _, doc in _all("Deployment", EXAMPLES / directory)]
    assert jobs, f"{directory}: no SnapshotJob"
    assert deployments, f"{directory}: no Deployment"
    for deployment in deployments:
        template = deployment["spec"]["template"]
        where = f"{directory}/{deployment['metadata']['name']}"
        name = template["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM]
        assert name in jobs, f"{where}: restore-from {name!r} is not a SnapshotJob of {directory}"
        job_spec = jobs[name]["spec"]
        [target] = job_spec["podSnapshotTemplate"]["targetContainers"]
        source = _pod_template_container(job_spec["podTemplate"]["spec"], target, name)
        restored = _pod_template_container(template["spec"], target, where)
        for key in ("image", "command", "args", "workingDir", "env", "resources"):
            assert restored.get(key) == source.get(key), f"{where}: {key} differs from the SnapshotJob's"
        env = {e["name"] for e in restored.get("env") or []}
        assert not env & {*protocol.ENV_CONTROL_DIRS, *protocol.ENV_RESTORE_STANDBYS}, where
        assert protocol.CONTROL_VOLUME_NAME not in {v["name"] for v in template["spec"].get("volumes") or []}
        # The engine knows nothing of snapshots: the SDK's wrapper gives it the workload contract.
        assert restored["command"][:3] == ["python3", "-m", "dynamo_snapshot.workload.wrap"], where
        assert "--ready-url" in restored["command"], where


def _identities() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for path, ckpt in _all(CKPT):
        yield f"{path.relative_to(EXAMPLES)}", ckpt["spec"]["identity"], _checkpoint_container(ckpt)
    for path, dgd in _all(DGD):
        for svc_name, svc in _checkpointed_services(dgd).items():
            if "identity" in svc["checkpoint"]:
                where = f"{path.relative_to(EXAMPLES)}:{svc_name}"
                yield where, svc["checkpoint"]["identity"], _main_container(svc)


def test_identity_says_what_the_worker_runs() -> None:
    seen = 0
    for where, identity, container in _identities():
        seen += 1
        backend = identity["backendFramework"]
        assert container["command"] == ["python3", "-m", f"dynamo.{backend}"], where
        args = [str(a) for a in container["args"]]
        flags = FLAGS[backend]
        assert _flag(args, flags["model"]) == identity["model"], where
        for field, flag in flags.items():
            given = _flag(args, flag)
            if field in identity and given is not None:
                assert given == str(identity[field]), f"{where}: {flag} {given} but identity {field}"
        if identity.get("tensorParallelSize", 1) > 1:
            assert _flag(args, flags["tensorParallelSize"]) is not None, where
    assert seen == 2 * len(FRAMEWORKS)


_POD_MATCHER = re.compile(r'pod=~"([^"]*)"')
_NS_MATCHER = re.compile(r'namespace="([^"]*)"')


def test_policies_target_a_checkpointed_service_and_select_its_pods() -> None:
    for path, policy in _all(POLICY):
        target = policy["spec"]["target"]
        dgds = {d["metadata"]["name"]: d for _, d in _all(DGD, path.parent)}
        assert target["dgdName"] in dgds, f"{path}: no DGD {target['dgdName']} beside it"
        services = _checkpointed_services(dgds[target["dgdName"]])
        assert target["serviceName"] in services, f"{path}: {target['serviceName']} is not checkpointed"
        prefix = pod_name_prefix(target["dgdName"], target["serviceName"])
        for metric in policy["spec"]["metrics"]:
            query = metric["query"]
            assert set(_NS_MATCHER.findall(query)) == {NAMESPACE}, f"{path}: {metric['name']}"
            for pattern in _POD_MATCHER.findall(query):
                assert pattern == f"{prefix}-.*", f"{path}: {metric['name']} selects {pattern!r}"
                assert re.fullmatch(pattern, new_pod_name(target["dgdName"], target["serviceName"]))


# --- the real apiserver ----------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("path", MANIFEST_FILES, ids=IDS)
def test_applies_with_server_side_dry_run(
    cluster: LocalCluster, crds: list[str], namespace: str, path: Path
) -> None:
    answer = json.loads(server_dry_run(cluster, namespace, path, check=True).stdout)
    stored_by_name = {
        (item["kind"], item["metadata"]["name"]): item
        for item in (answer["items"] if answer["kind"] == "List" else [answer])
    }
    for doc in _documents(path):
        stored = stored_by_name[doc["kind"], doc["metadata"]["name"]]
        assert stored["metadata"]["namespace"] == namespace
        # The apiserver kept every field (only defaults added), and the result is still a valid object.
        assert lost(doc["spec"], stored["spec"]) == []
        builtin = _builtin(doc)
        if builtin is None:
            MODELS[doc["kind"]].model_validate(stored)
        # A dry run: nothing was stored.
        plural = builtin or MODELS[doc["kind"]].resource.crd_name
        got = cluster.kubectl("get", plural, doc["metadata"]["name"], "-n", namespace, check=False)
        assert got.returncode != 0
        assert "NotFound" in got.stderr


def _applied_name(doc: dict[str, Any]) -> str:
    kind = _builtin(doc) or f"{MODELS[doc['kind']].resource.singular}.{protocol.API_GROUP}"
    return f"{kind}/{doc['metadata']['name']}"


@pytest.mark.cluster
@pytest.mark.parametrize("framework", FRAMEWORKS + PLAIN)
def test_directory_applies_as_the_readme_says(
    cluster: LocalCluster, crds: list[str], namespace: str, framework: str
) -> None:
    directory = EXAMPLES / framework
    out = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", f"{directory}/").stdout
    created = sorted(
        line.split()[0] for line in out.splitlines() if line.endswith("created (server dry run)")
    )
    expected = sorted(
        _applied_name(doc) for path in MANIFEST_FILES if path.parent == directory for doc in _documents(path)
    )
    assert created == expected, out


def _first_checkpointed(dgd: dict[str, Any]) -> str:
    return next(iter(_checkpointed_services(dgd)))


def _files_of(kind: str) -> dict[str, Any]:
    """pytest.mark.parametrize arguments: the files holding ``kind``, with readable ids."""
    paths = sorted({path for path, _ in _all(kind)})
    return {"argvalues": paths, "ids": [path.relative_to(EXAMPLES).as_posix() for path in paths]}


@pytest.mark.cluster
@pytest.mark.parametrize("path", **_files_of(DGD))
def test_broken_dgd_is_refused_naming_the_field(
    cluster: LocalCluster, crds: list[str], namespace: str, path: Path
) -> None:
    [dgd] = _documents(path)
    svc = _first_checkpointed(dgd)

    negative = copy.deepcopy(dgd)
    negative["spec"]["services"][svc]["replicas"] = -1
    error = refused_by_both(cluster, namespace, negative, "replicas", dry_run=True)
    assert f"spec.services.{svc}.replicas" in error
    assert "greater than or equal to 0" in error

    bad_mode = copy.deepcopy(dgd)
    bad_mode["spec"]["services"][svc]["checkpoint"]["mode"] = "Sometimes"
    error = refused_by_both(cluster, namespace, bad_mode, "mode", dry_run=True)
    assert f"spec.services.{svc}.checkpoint.mode" in error
    assert '"Sometimes"' in error

    # The unbroken file still applies: what failed above is the one field changed.
    assert server_dry_run(cluster, namespace, dgd).returncode == 0


@pytest.mark.cluster
@pytest.mark.parametrize("path", **_files_of(CKPT))
def test_broken_checkpoint_is_refused_naming_the_field(
    cluster: LocalCluster, crds: list[str], namespace: str, path: Path
) -> None:
    [ckpt] = _documents(path)
    broken = copy.deepcopy(ckpt)
    broken["spec"]["identity"]["backendFramework"] = "tensorflow"
    error = refused_by_both(cluster, namespace, broken, "backendFramework", dry_run=True)
    assert "spec.identity.backendFramework" in error
    assert "tensorflow" in error

    no_deadline = copy.deepcopy(ckpt)
    no_deadline["spec"]["job"]["activeDeadlineSeconds"] = 0
    error = refused(cluster, namespace, no_deadline, dry_run=True)
    assert "spec.job.activeDeadlineSeconds" in error


@pytest.mark.cluster
@pytest.mark.parametrize("path", **_files_of(POLICY))
def test_broken_policy_is_refused_naming_the_field(
    cluster: LocalCluster, crds: list[str], namespace: str, path: Path
) -> None:
    [policy] = _documents(path)
    zero = copy.deepcopy(policy)
    zero["spec"]["metrics"][0]["targetPerReplica"] = 0
    error = refused_by_both(cluster, namespace, zero, TARGET_PER_REPLICA_MESSAGE, dry_run=True)
    assert "spec.metrics[0].targetPerReplica" in error
    assert TARGET_PER_REPLICA_MESSAGE in error

    # A misspelt key: the model ignores unknown keys (and would take the default for the real one), the
    # apiserver's strict field validation refuses it.
    typo = copy.deepcopy(policy)
    typo["spec"]["maxReplica"] = typo["spec"].pop("maxReplicas")
    error = refused(cluster, namespace, typo, dry_run=True)
    assert "maxReplica" in error


# --- a real Prometheus -----------------------------------------------------------------------------

_GAUGE_QUERY = re.compile(r"^sum\(([a-zA-Z_:][a-zA-Z0-9_:]*)\{[^}]*\}\)$")
_METRIC_IN_QUERY = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+|dynamo_[a-z_]+)\{")
# Pods whose histograms never move: a query pointed at them sees a service without traffic.
QUIET = "quiet-worker"
TTFT_P95 = 0.095  # every observation below 0.1 s: the interpolated p95 of the first bucket


def _one_line(query: str) -> str:
    return " ".join(query.split())


def _metric_names() -> tuple[set[str], set[str]]:
    """(gauges, histograms) the example queries read."""
    gauges: set[str] = set()
    histograms: set[str] = set()
    for _, policy in _all(POLICY):
        for metric in policy["spec"]["metrics"]:
            names = set(_METRIC_IN_QUERY.findall(_one_line(metric["query"])))
            histograms |= {n.removesuffix("_bucket") for n in names if n.endswith("_bucket")}
            gauges |= {n for n in names if not n.endswith("_bucket")}
    return gauges, histograms


class _Exposition:
    """Serves Prometheus text for worker pods named as the controller names them, the same pod names in
    another namespace, and a few quiet pods; histograms of the non-quiet pods grow by 10 a second."""

    def __init__(self) -> None:
        self.gauges: dict[tuple[str, str, str], float] = {}  # (metric, namespace, pod) -> value
        gauge_names, histogram_names = _metric_names()
        self.pods: list[tuple[str, str]] = [
            (NAMESPACE, new_pod_name(dgd["metadata"]["name"], svc))
            for _, dgd in _all(DGD)
            for svc in _checkpointed_services(dgd)
            for _ in range(2)
        ]
        self.pods += [("elsewhere", pod) for _, pod in self.pods]
        self.pods += [(NAMESPACE, "frontend-0"), (NAMESPACE, f"{QUIET}-0"), (NAMESPACE, f"{QUIET}-1")]
        for metric in sorted(gauge_names):
            for i, (ns, pod) in enumerate(self.pods):
                self.gauges[(metric, ns, pod)] = (i + 1) * 0.25 if ns == NAMESPACE else 1000.0
        self.histograms = sorted(histogram_names)
        self.started = time.monotonic()
        self._server = StubServer(lambda: (200, "text/plain; version=0.0.4", self.render().encode()))
        self.address = self._server.address

    def render(self) -> str:
        lines: list[str] = []
        for metric in sorted({m for m, _, _ in self.gauges}):
            lines.append(f"# TYPE {metric} gauge")
            lines += [
                f'{metric}{{namespace="{ns}",pod="{pod}"}} {value}'
                for (m, ns, pod), value in self.gauges.items()
                if m == metric
            ]
        grown = int((time.monotonic() - self.started) * 10)
        for metric in self.histograms:
            lines.append(f"# TYPE {metric} histogram")
            for ns, pod in self.pods:
                count = 7 if pod.startswith(QUIET) else 7 + grown
                labels = f'namespace="{ns}",pod="{pod}"'
                lines += [f'{metric}_bucket{{{labels},le="{le}"}} {count}' for le in ("0.1", "0.5", "+Inf")]
                lines += [f"{metric}_sum{{{labels}}} {count * 0.05}", f"{metric}_count{{{labels}}} {count}"]
        return "\n".join(lines) + "\n"

    def matching(self, query: str) -> list[tuple[str, str]]:
        """The pods a query's namespace and pod matchers select."""
        pattern = (_POD_MATCHER.findall(query) or [".*"])[0]
        namespaces = set(_NS_MATCHER.findall(query))
        return [
            (ns, pod)
            for ns, pod in self.pods
            if (not namespaces or ns in namespaces) and re.fullmatch(pattern, pod)
        ]

    def expected_sum(self, query: str) -> float:
        found = _GAUGE_QUERY.match(_one_line(query))
        assert found, query
        return sum(self.gauges[(found.group(1), ns, pod)] for ns, pod in self.matching(query))

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture(scope="module")
def exposition() -> Iterator[_Exposition]:
    served = _Exposition()
    yield served
    served.stop()


@pytest.fixture(scope="module")
def prometheus(
    exposition: _Exposition, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPrometheus]:
    with local_prometheus([exposition.address], tmp_path_factory.mktemp("prometheus")) as server:
        yield server


async def _settled(source: PrometheusSource, query: str, within: float = 15.0) -> float:
    """The query's value once it is non-zero (a rate needs two scrapes); the last answer otherwise.
    Raises what the autoscaler would see: InvalidQuery, NotOneSeries, NoData."""
    deadline = time.monotonic() + within
    while True:
        try:
            value = await source.query_total(query)
        except NoData:
            if time.monotonic() > deadline:
                raise
        else:
            if value != 0 or time.monotonic() > deadline:
                return value
        await asyncio.sleep(0.25)


@pytest.mark.parametrize("path", **_files_of(POLICY))
async def test_policy_queries_count_the_target_pods_on_a_real_prometheus(
    prometheus: LocalPrometheus, exposition: _Exposition, path: Path
) -> None:
    [policy] = _documents(path)
    source = PrometheusSource(prometheus.url, timeout_s=5.0)
    try:
        for metric in policy["spec"]["metrics"]:
            query = metric["query"]
            selected = exposition.matching(query)
            assert selected, f"{metric['name']} selects no pod"
            assert all(ns == NAMESPACE for ns, _ in selected), f"{metric['name']} counts another namespace"
            try:
                value = await _settled(source, query)
            except PrometheusError as e:
                pytest.fail(f"{path.name} {metric['name']}: the autoscaler could not use it: {e}")
            if _GAUGE_QUERY.match(_one_line(query)):
                assert value == pytest.approx(exposition.expected_sum(query)), metric["name"]
                continue
            # The TTFT ratio: p95 times the number of worker pods.
            assert value == pytest.approx(TTFT_P95 * len(selected)), metric["name"]
            # The same query over pods without traffic: 0, which may scale down, not "missing", which
            # would hold the replicas where they are.
            [pattern] = set(_POD_MATCHER.findall(query))
            quiet = query.replace(pattern, f"{QUIET}-.*")
            assert await source.query_total(quiet) == 0.0
    finally:
        source.close()
