"""The node agent: the privileged per-node process that checkpoints ready workers and restores new ones.

Split like ai-dynamo/snapshot's agent: `runtime/` (how a pod's processes are found, launched, dumped and
restored: the kubelet's containers, or host processes and runc containers the agent launches);
`executor` (the entry point over CUDA, CRIU and the artifact store: `Executor`), whose procedures are
`checkpoint` and `restore` (each a list of named stages), over `node` (the tools and settings they share),
`page_images`, `cuda_processes`, `gpu_assignment`, `weights` and `prefetch`; `watcher` (the Kubernetes
side: pods of this node), with `pod_spec`, `pod_reports`, `kubelet_containers`, `artifact_sweeper` and
`authorize`.
"""
