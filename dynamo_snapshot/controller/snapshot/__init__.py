"""The generic layer, NVIDIA Snapshot's API: PodSnapshots bound to their PodSnapshotContents, SnapshotJobs,
and the restore webhook's shaping of pods that name a snapshot in nvidia.com/restore-from."""
