"""The executor runs where no Kubernetes client is installed (the GPU benchmarks' device, `dynamo-snapshot
checkpoint` on a host): importing it must not pull kubernetes_asyncio in."""

from __future__ import annotations

import subprocess
import sys

BLOCK_AND_IMPORT = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "kubernetes_asyncio" or name.startswith("kubernetes_asyncio."):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, Block())
import dynamo_snapshot.agent.executor
print("ok")
"""


def test_the_executor_imports_without_the_kubernetes_client() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_AND_IMPORT], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"
