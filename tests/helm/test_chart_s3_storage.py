"""storage.type s3 in the chart: the agent is told the store, reads its credentials from the Secret and its
CA from the ConfigMap the DaemonSet mounts, keeps artifacts on each node (fetched ones in its node cache),
and bad values are refused at install with the reason."""

from __future__ import annotations

from typing import Any

import yaml

from dynamo_snapshot.agent.config import AgentConfig
from tests.helm.chart import one, render, template

S3: dict[str, Any] = {
    "type": "s3",
    "s3": {
        "endpoint": "https://s3.internal:9000",
        "bucket": "checkpoints",
        "prefix": "prod/",
        "credentialsSecret": "s3-credentials",
        "caBundle": {"configMap": "internal-ca", "key": "bundle.pem"},
    },
}


def _agent(objs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    ds = one(objs, "DaemonSet", "-agent")
    return ds["spec"]["template"]["spec"], one(objs, "ConfigMap", "-agent")


def test_the_agent_gets_the_store_its_credentials_and_its_ca() -> None:
    pod, cm = _agent(render({"storage": S3}))
    config = AgentConfig.model_validate({**yaml.safe_load(cm["data"]["config.yaml"]), "nodeName": "n"})
    location = config.s3.location()
    assert location is not None
    assert (location.endpoint, location.bucket, location.prefix) == (
        "https://s3.internal:9000",
        "checkpoints",
        "prod/",
    )
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["s3-credentials"]["secret"]["secretName"] == "s3-credentials"
    assert volumes["s3-ca"]["configMap"]["name"] == "internal-ca"
    assert "hostPath" in volumes["artifacts"]  # each node's own copies
    mounts = {m["name"]: m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
    assert mounts["s3-credentials"] == str(config.s3.s3_credentials_dir)
    assert config.s3.s3_ca_bundle is not None
    assert str(config.s3.s3_ca_bundle) == f"{mounts['s3-ca']}/bundle.pem"
    # Fetched copies go into the node cache, on even where agent.cache is not asked for.
    assert config.cache.cache_root is not None
    assert mounts["artifact-cache"] == str(config.cache.cache_root)
    assert volumes["artifact-cache"]["hostPath"]["path"] == str(config.cache.cache_root)


def test_the_volume_store_has_no_object_store() -> None:
    pod, cm = _agent(render())
    config = AgentConfig.model_validate({**yaml.safe_load(cm["data"]["config.yaml"]), "nodeName": "n"})
    assert config.s3.location() is None
    assert config.cache.cache_root is None
    assert not {"s3-credentials", "s3-ca", "artifact-cache"} & {v["name"] for v in pod["volumes"]}


def test_bad_storage_values_are_refused_with_the_reason() -> None:
    cases = [
        ({**S3, "s3": {**S3["s3"], "credentialsSecret": ""}}, {}, "needs storage.s3.credentialsSecret"),
        ({**S3, "s3": {**S3["s3"], "endpoint": ""}}, {}, "needs storage.s3.endpoint"),
        ({**S3, "s3": {**S3["s3"], "endpoint": "ftp://x"}}, {}, "endpoint"),
        ({**S3, "type": "nfs"}, {}, "type"),
        (S3, {"persistence": {"enabled": True}}, "turn artifacts.persistence off"),
    ]
    for storage, artifacts, says in cases:
        proc = template({"storage": storage, "artifacts": artifacts})
        assert proc.returncode != 0, storage
        assert says in proc.stderr, proc.stderr


def test_a_bucket_per_namespace_reaches_the_agent() -> None:
    storage = {**S3, "s3": {**S3["s3"], "bucket": "ckpt-{namespace}"}}
    _, cm = _agent(render({"storage": storage}))
    config = AgentConfig.model_validate({**yaml.safe_load(cm["data"]["config.yaml"]), "nodeName": "n"})
    location = config.s3.location()
    assert location is not None
    assert location.for_key("team-a/0d3c").bucket == "ckpt-team-a"
