"""The node agent: the privileged per-node process that checkpoints ready workers and restores new ones.

Split like ai-dynamo/snapshot's agent: `runtime/` (how a pod's processes are found, launched, dumped and
restored: the kubelet's containers, or host processes and runc containers the agent launches),
`executor` (the checkpoint and restore procedures over
CUDA, CRIU and the artifact store), `watcher` (the Kubernetes side: pods of this node, annotations).
"""
