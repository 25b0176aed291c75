"""Worker failover's policy, shared by the controller's own DGD workers and the Dynamo operator's pods:
which worker is lost, and the pacing and brakes of its replacement. Memory only, no informer of its own."""
