"""The Dynamo layer, on the generic one: DynamoGraphDeployments (their worker pods and status),
DynamoCheckpoints (taken with a SnapshotJob), the DGD conversion webhook, and, beside NVIDIA's Dynamo
operator, the failover of its worker pods by restore."""
