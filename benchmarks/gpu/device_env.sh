# Sourced by the device scripts: the carried wheels installed, and CRIU from the carried bundle.
# The bundle's own wrapper finds itself with $(dirname "$0"), one more program to exec (and read from
# a disk busy with a restore's bulk reads) before CRIU starts; this one has the paths written in.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    || echo "device_env: installing the carried wheels failed (see pip's message above)" >&2
bundle=$PWD/.criu-bundle
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/lib exec %s/criu "$@"\n' "$bundle" "$bundle" > "$bundle/criu-direct.sh"
chmod +x "$bundle/criu-direct.sh"
export PYTHONPATH=/tmp/site:$PWD DYNSNAP_CRIU=$bundle/criu-direct.sh
