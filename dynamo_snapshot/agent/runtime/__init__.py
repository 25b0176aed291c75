"""How the agent finds, launches, dumps and restores a pod's worker: host processes or runc containers."""

from dynamo_snapshot.agent.runtime.base import Runtime, Workload, WorkloadRuntimeError, WorkloadSpec
from dynamo_snapshot.agent.runtime.process import ProcessRuntime
from dynamo_snapshot.agent.runtime.runc import RuncRuntime

__all__ = ["ProcessRuntime", "RuncRuntime", "Runtime", "Workload", "WorkloadRuntimeError", "WorkloadSpec"]
