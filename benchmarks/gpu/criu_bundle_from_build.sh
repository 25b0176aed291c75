#!/usr/bin/env bash
# The project's own CRIU build (4.1.1 and scripts/criu-*.patch, which scripts/test-env.sh builds
# into ~/.cache/dynamo-snapshot/bin) as a bundle for the H200: the binary and the shared libraries it
# links, glibc left to the machine (built against an older one than the H200's Ubuntu 24.04 has).
# Usage: benchmarks/gpu/criu_bundle_from_build.sh DIR; then carry DIR (an ignored path) and, on the device,
#   rm -rf .criu-bundle && mv DIR .criu-bundle && . benchmarks/gpu/device_env.sh
set -euo pipefail
out=${1:?usage: criu_bundle_from_build.sh DIR}
criu=${DYNSNAP_CRIU_BUILD:-$HOME/.cache/dynamo-snapshot/bin/criu}
[ -x "$criu" ] || { echo "no CRIU build at $criu: run scripts/test-env.sh first" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out/lib"
cp "$criu" "$out/criu"
ldd "$criu" | awk '/=>/ {print $3}' | grep -vE '/(libc\.so|ld-linux)' | while read -r lib; do
    cp -L "$lib" "$out/lib/"
done
"$out/criu" --version | head -1
du -sh "$out"
