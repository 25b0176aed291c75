#!/usr/bin/env bash
# The Auto-mode story in kubelet pods on the GPU machine (benchmarks/gpu/pod_story.py), in one device call:
#   python3 scripts/gpu_bundle.py pack .gpu-bundle        # here, once: the node's binaries (about 43 MiB)
#   run(command="bash benchmarks/gpu/run_pod_story_h200.sh 1g", carry=[".gpu-bundle", ".whl", ".gpu-extra"])
# .whl holds the project's dependencies for Python 3.12 (pydantic, kubernetes-asyncio, ...; BENCHMARKS.md),
# .gpu-extra/openssl.tar.xz the openssl command the local control plane makes its certificates with, used
# only where the machine has none. Writes OUT/gpu-pod-gpu-<size>.json, OUT/story.log, OUT/logs.tar.xz and
# the process-path baseline (restore_bench.py, decoupled) OUT/gpu-restore-<size>-process.json.
# STORY=0 or PROCESS_BASELINE=0 leaves one out: the two and the image build do not fit one call of 10
# minutes, so the baseline goes in a second call on the same warm machine (an idle one goes back in 30 s).
set -uo pipefail
size=${1:-1g}
: "${OUT:?OUT must be set (the device tool sets it)}"
exec > >(tee "$OUT/story.log") 2>&1
t0=$SECONDS
export DYNSNAP_CACHE=/var/tmp/dsnap-cache PYTHONUNBUFFERED=1
python3 -I scripts/gpu_bundle.py unpack .gpu-bundle || exit 1
python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=$DYNSNAP_CACHE/bin:$PATH DYNSNAP_CRIU=$DYNSNAP_CACHE/bin/criu
if ! command -v openssl > /dev/null; then
    tar -C /var/tmp -xJf .gpu-extra/openssl.tar.xz && ln -sfn /var/tmp/openssl/openssl.sh "$DYNSNAP_CACHE/bin/openssl"
    echo "openssl: carried ($(openssl version))"
fi
echo "set-up $((SECONDS - t0)) s; $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader)"
rc=0
if [ "${STORY:-1}" = 1 ]; then
    timeout "${STORY_TIMEOUT:-500}" python3 benchmarks/gpu/pod_story.py --worker gpu --size "$size" \
        --work /var/tmp/dsnap-story --out "$OUT"
    rc=$?
    echo "story rc=$rc after $((SECONDS - t0)) s"
fi
# The same worker restored as a bare process (the agent's ProcessRuntime) on the same machine and disk:
# the baseline of the in-pod restores. Its cold start compiles from an empty cache too.
if [ "${PROCESS_BASELINE:-1}" = 1 ]; then
    timeout "${BASELINE_TIMEOUT:-280}" python3 benchmarks/gpu/restore_bench.py --size "$size" --modes decoupled \
        --tag process --warm-restore --no-bad-inputs --no-diagnostics --calib-gib 2 \
        --work /var/tmp/restore-bench --out "$OUT" > "$OUT/process-baseline.log" 2>&1
    echo "process-path baseline rc=$? after $((SECONDS - t0)) s"
fi
# What the node, the control plane and the pods logged, for a failure's reason.
find /var/tmp/dsnap-story /var/log/pods -name '*.log' -size -8M 2>/dev/null | tar -cJf "$OUT/logs.tar.xz" -T - 2>/dev/null
exit $rc
