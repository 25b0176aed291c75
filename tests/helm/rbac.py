"""What the chart's RBAC grants with its defaults, stated once as (apiGroup, resource, resourceName or "*",
verb): test_chart.py checks the rendered Roles grant exactly this, test_chart_cluster.py asks the real
apiserver (kubectl auth can-i, as the service accounts) whether each of it is allowed."""

from __future__ import annotations

Grant = tuple[str, str, str, str]

OURS = "nvidia.com"
LEASE_NAME = "dynamo-snapshot-controller"
DGD_CRD = "dynamographdeployments.nvidia.com"
# The CRDs the controller reads at start (controller/install_mode.py): the DGD's, and the snapshot kinds'.
CRDS_READ_AT_START = (
    DGD_CRD,
    "dynamocheckpoints.nvidia.com",
    "podsnapshots.nvidia.com",
    "podsnapshotcontents.nvidia.com",
    "snapshotjobs.nvidia.com",
)

# The controller's ClusterRole: the calls in dynamo_snapshot/controller, kube and autoscale.
CONTROLLER: set[Grant] = (
    {("", "pods", "*", v) for v in ("list", "watch", "create", "delete")}
    | {("batch", "jobs", "*", v) for v in ("get", "list", "watch", "create", "delete")}
    | {("", "events", "*", "create"), ("", "events", "*", "patch")}
    | {(OURS, "dynamographdeployments", "*", v) for v in ("list", "watch", "patch")}
    | {(OURS, "dynamographdeployments/status", "*", "update")}
    | {(OURS, "dynamocheckpoints", "*", v) for v in ("get", "list", "watch", "create", "patch")}
    | {(OURS, "dynamocheckpoints/status", "*", "patch")}
    | {(OURS, "podsnapshots", "*", v) for v in ("get", "list", "watch", "create", "patch", "delete")}
    | {(OURS, "podsnapshots/status", "*", "patch")}
    | {(OURS, "snapshotjobs", "*", v) for v in ("list", "watch", "create")}
    | {(OURS, "snapshotjobs/status", "*", "patch")}
    | {("", "pods", "*", "get")}
    | {
        (OURS, f"{r}/finalizers", "*", "update")
        for r in ("dynamographdeployments", "dynamocheckpoints", "snapshotjobs")
    }
    | {(OURS, "dynamoscalingpolicies", "*", v) for v in ("list", "watch")}
    | {(OURS, "dynamoscalingpolicies/status", "*", "patch")}
)
# The controller's second ClusterRole, for cluster-scoped kinds: bound cluster-wide even when one namespace
# is watched.
CONTROLLER_CLUSTER_SCOPED: set[Grant] = (
    {("", "nodes", "*", "list"), ("", "nodes", "*", "watch")}
    | {(OURS, "podsnapshotcontents", "*", v) for v in ("get", "list", "watch", "create", "delete")}
    # Read at start: whose DGD CRD it is, against the install mode, and whose the snapshot kinds' are.
    | {("apiextensions.k8s.io", "customresourcedefinitions", crd, "get") for crd in CRDS_READ_AT_START}
)
# Mode dynamo-operator: NVIDIA's Dynamo operator runs the DGDs, so the controller's ClusterRole grants no
# DGD status and no owner references; it reads (get) the controller chain of a lost operator pod up to its
# DGD (controller/dynamo/operator_chain.py), and the autoscaler reads the DGDs and their scaling adapters and
# writes replicas through an adapter's scale subresource, else the DGD (autoscale/targets.py).
OPERATOR_CHAIN: set[Grant] = {
    ("apps", "replicasets", "*", "get"),
    ("apps", "deployments", "*", "get"),
    ("apps", "statefulsets", "*", "get"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "*", "get"),
    ("grove.io", "podcliques", "*", "get"),
    ("grove.io", "podcliquescalinggroups", "*", "get"),
    ("grove.io", "podcliquesets", "*", "get"),
    (OURS, "dynamocomponentdeployments", "*", "get"),
    (OURS, "dynamographdeployments", "*", "get"),
}
OPERATOR_AUTOSCALER: set[Grant] = (
    {(OURS, "dynamographdeployments", "*", v) for v in ("list", "watch", "patch")}
    | {(OURS, "dynamographdeploymentscalingadapters", "*", v) for v in ("list", "watch")}
    | {(OURS, "dynamographdeploymentscalingadapters/scale", "*", v) for v in ("get", "update")}
)
CONTROLLER_DYNAMO_OPERATOR: set[Grant] = (
    {g for g in CONTROLLER if not g[1].startswith("dynamographdeployments")}
    | OPERATOR_CHAIN
    | OPERATOR_AUTOSCALER
)
DGDSA_CRD = "dynamographdeploymentscalingadapters.nvidia.com"
# The leader-election Role, in the release's namespace.
LEADER_ELECTION: set[Grant] = {
    ("coordination.k8s.io", "leases", "*", "create"),
    ("coordination.k8s.io", "leases", LEASE_NAME, "get"),
    ("coordination.k8s.io", "leases", LEASE_NAME, "update"),
}
# The agent's ClusterRole.
AGENT: set[Grant] = {
    ("", "pods", "*", "list"),
    ("", "pods", "*", "watch"),
    ("", "pods", "*", "patch"),
    ("", "pods/status", "*", "patch"),
    ("", "events", "*", "create"),
    ("", "events", "*", "patch"),
    (OURS, "dynamocheckpoints", "*", "get"),
    (OURS, "podsnapshots", "*", "get"),
    (OURS, "podsnapshots", "*", "list"),
    (OURS, "podsnapshots", "*", "watch"),
    (OURS, "podsnapshotcontents", "*", "get"),
    (OURS, "podsnapshotcontents", "*", "list"),
    (OURS, "podsnapshotcontents", "*", "watch"),
    (OURS, "podsnapshotcontents", "*", "patch"),
    (OURS, "podsnapshotcontents/status", "*", "patch"),
}


def can_i(grant: Grant) -> tuple[str, ...]:
    """The `kubectl auth can-i` arguments that ask for ``grant``: VERB RESOURCE[.GROUP][/NAME], and
    --subresource=S for a subresource."""
    group, resource, name, verb = grant
    resource, _, subresource = resource.partition("/")
    target = f"{resource}.{group}" if group else resource
    if name != "*":
        target += f"/{name}"
    return (verb, target, *([f"--subresource={subresource}"] if subresource else []))
