"""The dynamo-snapshot controller: reconcilers on the Kubernetes mechanics of ``dynamo_snapshot.kube``."""
