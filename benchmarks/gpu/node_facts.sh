#!/usr/bin/env bash
# What a Kubernetes node on the GPU machine has to work with, read off the machine itself before anything
# is designed for it (docs/gpu-node.md cites the answers):
#   run(command="bash benchmarks/gpu/node_facts.sh")
# Prints and writes $OUT/node-facts.txt. Changes nothing that outlives the call (the bridge, veth pair,
# overlay mount and cgroup made to try them are removed again). About 20 s.
set -u
out=${OUT:-/tmp}/node-facts.txt
exec > >(tee "$out") 2>&1
section() { printf '\n=== %s\n' "$*"; }
try() { printf '$ %s\n' "$*"; timeout 20 bash -c "$*" 2>&1 | head -"${LINES_MAX:-40}"; printf '[rc=%s]\n' "${PIPESTATUS[0]}"; }

section machine
try 'uname -a; cat /etc/os-release | head -4; nproc; free -g | head -2; df -h / /tmp /var 2>/dev/null'
try 'cat /proc/1/comm; ps -o pid,comm -p 1'
try 'cat /proc/cmdline'

section cgroups
try 'stat -fc %T /sys/fs/cgroup; grep cgroup /proc/mounts'
try 'cat /sys/fs/cgroup/cgroup.controllers /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null; cat /proc/self/cgroup'
try 'd=/sys/fs/cgroup/dsnap-probe; mkdir $d && echo $$ > $d/cgroup.procs && echo moved && echo $$ > /sys/fs/cgroup/cgroup.procs; rmdir $d; ls /sys/fs/cgroup | head -30'

section kernel features
try 'grep -E "overlay|tmpfs|cgroup" /proc/filesystems'
try 'ls /proc/config.gz 2>/dev/null && zcat /proc/config.gz | grep -E "^CONFIG_(OVERLAY_FS|BRIDGE|VETH|NETFILTER_XT_MATCH_CONNTRACK|NF_NAT|IP_NF_IPTABLES|NF_TABLES|BRIDGE_NETFILTER|CHECKPOINT_RESTORE|USERFAULTFD|MEM_SOFT_DIRTY|NAMESPACES|USER_NS|CGROUP_BPF|BPF_SYSCALL|SECCOMP)="'
try 'ls /lib/modules 2>/dev/null | head; lsmod 2>/dev/null | head'
try 'sysctl net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables kernel.ns_last_pid user.max_user_namespaces 2>&1'
try 'mkdir -p /tmp/ovl/{l,u,w,m} && echo x > /tmp/ovl/l/f && mount -t overlay overlay -o lowerdir=/tmp/ovl/l,upperdir=/tmp/ovl/u,workdir=/tmp/ovl/w /tmp/ovl/m && cat /tmp/ovl/m/f && umount /tmp/ovl/m; rm -rf /tmp/ovl'
try 'ip link add dsnapprobe0 type bridge && ip link add dsnapv0 type veth peer name dsnapv1 && ip link set dsnapv0 master dsnapprobe0 && echo bridge+veth ok; ip link del dsnapv0; ip link del dsnapprobe0'
try 'unshare --net --pid --mount --fork true && echo unshare ok'

section tools
for t in containerd containerd-shim-runc-v2 runc crun ctr crictl nerdctl docker podman iptables iptables-legacy iptables-nft nft ip ipset conntrack ebtables mount umount unshare nsenter tar zstd xz gzip python3 pip3 go gcc make criu cuda-checkpoint nvidia-container-cli nvidia-ctk socat curl; do
    p=$(command -v "$t" 2>/dev/null) && printf '%-24s %s\n' "$t" "$p" || printf '%-24s -\n' "$t"
done
try 'iptables --version; iptables -t nat -L -n | head -5; nft list tables 2>&1 | head'
try 'ls /opt/cni/bin /usr/lib/cni 2>&1 | head; ls /etc/containerd /var/lib/containerd /run/containerd 2>&1 | head'

section GPU
try 'nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id,uuid,compute_mode,persistence_mode --format=csv'
try 'ls -la /dev/nvidia* /dev/nvidia-caps 2>&1; cat /proc/driver/nvidia/version'
try 'cat /proc/devices | grep -i nvidia'
LINES_MAX=80 try 'ldconfig -p | grep -E "libcuda|libnvidia|libnvrtc" ; ls -la /usr/local/nvidia /usr/local/nvidia/lib64 2>&1 | head -40'
try 'for f in $(ldconfig -p | awk "/libcuda.so|libnvidia-ml.so|libnvidia-ptxjitcompiler/ {print \$NF}"); do readlink -f $f; done | sort -u'
try 'grep -E "nvidia|/usr/local" /proc/mounts'
try 'ls /usr/bin/nvidia* /usr/local/nvidia/bin 2>&1'

section python
try 'command -v python3; python3 -VV; python3 -c "import sys; print(sys.prefix, sys.base_prefix); print(sys.path)"'
try 'python3 -c "import torch, pydantic" 2>&1; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))"'
try 'du -sh $(python3 -c "import sys; print(sys.prefix)") $(python3 -c "import sys; print(sys.base_prefix)") 2>/dev/null; du -sh /opt/torch 2>/dev/null'
try 'python3 -c "import torch,os; print(os.path.dirname(torch.__file__))"; du -sh $(python3 -c "import torch,os; print(os.path.dirname(torch.__file__))")'
try 'python3 -m pip list 2>/dev/null | grep -iE "^(pydantic|kubernetes|aiohttp|prometheus|pyyaml|cachetools|cuda|nvidia-ml|pynvml|numpy|typing)" '
try 'ldd $(readlink -f $(command -v python3)) | head'

section disk
try 'mount | grep -E " / | /tmp | /var "; lsblk 2>/dev/null | head'
echo "written to $out"
