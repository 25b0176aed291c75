#!/usr/bin/env bash
# Installs, builds and caches every real component the tests and the local demo start:
#   dsnap-multicall (Go module proxy, version-stamped; scripts/nodebin): kube-apiserver, kube-scheduler,
#     kube-controller-manager, kubectl, etcd, and the real node's kubelet, kube-proxy, containerd 2.x + shim +
#     ctr and gpu-device-plugin, all one program, linked under each name
#   runc (static, with seccomp) and the CNI bridge/host-local/loopback plugins (Go module proxy)
#   kwok, helm                                                         (Go module proxy)
#   criu 4.x (Debian 13 source, built here), prometheus, iptables, busybox-static (Debian)
# Idempotent: a warm cache costs seconds. Everything lands in $DYNSNAP_CACHE (default ~/.cache/dynamo-snapshot);
# binaries in $DYNSNAP_CACHE/bin. Prints `export PATH=...` hints at the end.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
CACHE=${DYNSNAP_CACHE:-$HOME/.cache/dynamo-snapshot}
BIN=$CACHE/bin
SRC=$CACHE/src
mkdir -p "$BIN" "$SRC"
t_start=$SECONDS

say() { printf '[test-env %3ds] %s\n' "$((SECONDS - t_start))" "$*"; }
die() { printf 'test-env: %s\n' "$*" >&2; exit 1; }
stamp_ok() { [ -f "$BIN/.stamp-$1" ] && [ "$(cat "$BIN/.stamp-$1")" = "$2" ]; }
stamp() { printf '%s' "$2" > "$BIN/.stamp-$1"; }

[ "$(id -u)" = 0 ] || die "must run as root (CRIU, apt and the fake GPU nodes need it): re-run with sudo"
command -v go >/dev/null || die "Go is missing: install Go >= 1.26 (https://go.dev/dl) and re-run"
go_minor=$(go env GOVERSION | sed -E 's/^go1\.([0-9]+).*/\1/')
[ "$go_minor" -ge 26 ] || die "Go $(go env GOVERSION) is too old for Kubernetes $K8S_VERSION: install Go >= 1.26"
command -v apt-get >/dev/null || die "apt-get is missing: this script supports Debian 12/13 machines"

export GOFLAGS=-mod=mod GOTOOLCHAIN=local
export CGO_ENABLED=0

# ---------------------------------------------------------------- Debian packages
apt_updated=0
apt_update() { [ "$apt_updated" = 1 ] || { say "apt-get update"; apt-get update -qq >/dev/null || die "apt-get update failed: check the network / mirror"; apt_updated=1; }; }
apt_need() {
  local missing=()
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  apt_update
  say "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
}

# Debian 13 packages are fetched from a trixie source list that lives only while we download: installing
# trixie's criu on Debian 12 would drag libc6 2.41 and a partial dist-upgrade, so its source is built here.
with_trixie() {
  local list=/etc/apt/sources.list.d/dynamo-snapshot-trixie.sources
  local pin=/etc/apt/preferences.d/dynamo-snapshot-trixie
  printf 'Types: deb deb-src\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' > "$list"
  printf 'Package: *\nPin: release n=trixie\nPin-Priority: 1\n' > "$pin"
  apt-get update -qq >/dev/null || { rm -f "$list" "$pin"; die "apt-get update with the trixie suite failed"; }
  local rc=0
  "$@" || rc=$?
  rm -f "$list" "$pin"
  apt-get update -qq >/dev/null || true
  return $rc
}

# Debian's runc goes into the agent's image (localcluster.project_images); the real node runs the static one
# built below.
apt_need ca-certificates curl runc prometheus iproute2 procps
# the real node (localcluster.realnode): iptables for the kubelet and kube-proxy, busybox for the local
# test image, Debian's Python and util-linux (nsenter, unshare) for the worker image and the agent's restore
# into a pod; libseccomp's static library for runc
apt_need iptables busybox-static python3.11 util-linux libseccomp-dev
# criu build dependencies (bookworm versions are fine for criu 4.1)
apt_need build-essential pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler \
  python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev libaio-dev \
  uuid-dev xz-utils

# ---------------------------------------------------------------- criu (Debian 13 source, built here)
build_criu() {
  local d=$SRC/criu-$CRIU_DEB_VERSION
  rm -rf "$d"; mkdir -p "$d"
  # Only the upstream tarball is needed; the mirror may lack the .dsc, so judge by the tarball alone.
  (cd "$d" && apt-get source --download-only -qq "criu=$CRIU_DEB_VERSION" >/dev/null 2>&1) || true
  compgen -G "$d/criu_*.orig.tar.*" >/dev/null
}
# criu-so-passcred.patch: kernels >= 6.16 refuse SO_PASSCRED/SO_PASSSEC on inet sockets, so stock 4.1.1 cannot
# dump any process with a TCP/UDP socket (upstream issues #2705/#2718, fixed after 4.1.1 by PR #2719).
# criu-restore-thp.patch: with CRIU_RESTORE_THP_DENSE in its environment a restore advises transparent huge
# pages for the private anonymous memory it fills densely, before reading it (the agent's
# --restore-huge-pages; BENCHMARKS.md, "Past the disk").
# criu-restore-readers.patch: with CRIU_RESTORE_READERS=N each task's restorer reads its pages with N threads
# (the agent's --restore-readers).
# The stamp names the patches so a cache built without them is rebuilt once.
criu_patches=("$here/criu-so-passcred.patch" "$here/criu-restore-thp.patch" "$here/criu-restore-readers.patch")
criu_rev="$CRIU_DEB_VERSION+patches-$(cat "${criu_patches[@]}" | sha256sum | cut -c1-12)"
if stamp_ok criu "$criu_rev" && [ -x "$BIN/criu" ]; then
  say "criu $criu_rev cached"
else
  d=$SRC/criu-$CRIU_DEB_VERSION
  if compgen -G "$d/criu_*.orig.tar.*" >/dev/null; then
    say "criu $CRIU_DEB_VERSION source cached"
  else
    say "fetching criu $CRIU_DEB_VERSION source (Debian 13)"
    with_trixie build_criu || die "could not download the criu $CRIU_DEB_VERSION source from Debian trixie"
  fi
  find "$d" -mindepth 1 -maxdepth 1 -type d -name 'criu-*' -exec rm -rf {} +
  tar -C "$d" -xf "$d"/criu_*.orig.tar.*
  top=$(find "$d" -mindepth 1 -maxdepth 1 -type d -name 'criu-*' | sed -n 1p)
  for criu_patch in "${criu_patches[@]}"; do
    patch -d "$top" -p1 --forward --quiet < "$criu_patch" || die "$(basename "$criu_patch") does not apply to $top"
  done
  say "building criu in $top (about 2 min on 2 cores)"
  make -C "$top" -j"$(nproc)" criu > "$d/build.log" 2>&1 || { tail -n 20 "$d/build.log" >&2; die "criu build failed: see $d/build.log"; }
  cp "$top/criu/criu" "$BIN/criu"
  stamp criu "$criu_rev"
fi

# ---------------------------------------------------------------- dsnap-multicall (scripts/nodebin)
# One Go program of the Kubernetes components, etcd, containerd and the GPU device plugin: one link of their
# shared dependencies (175 MB, where the separate binaries are 460 MB) and one build. Its go.mod is written
# here from versions.env: k8s.io/kubernetes with replace lines for its staging modules, etcd's server and
# containerd, and containerd's own containerd/api (Kubernetes asks for a newer one that containerd's
# sources do not build against).
MULTICALL_NAMES="kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy etcd containerd
  containerd-shim-runc-v2 ctr gpu-device-plugin"
build_multicall() {  # dir
  local d=$1 cd_mod=github.com/containerd/containerd/v2
  rm -rf "$d"; mkdir -p "$d"
  cp "$here"/nodebin/*.go "$d/"
  local cd_gomod cd_api
  cd_gomod=$(cd "$d" && GOFLAGS= go mod download -json "$cd_mod@$CONTAINERD_VERSION" | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')
  cd_api=$(sed -n 's#^\tgithub.com/containerd/containerd/api \(v[^ ]*\).*#\1#p' "$cd_gomod")
  [ -n "$cd_api" ] || { echo "no containerd/api requirement in $cd_gomod" >&2; return 1; }
  {
    printf 'module dynamo-snapshot.local/multicall\n\ngo 1.26.0\n\nrequire (\n'
    printf '\tk8s.io/kubernetes %s\n\t%s %s\n\tgo.etcd.io/etcd/server/v3 %s\n)\n\nreplace (\n' \
      "$K8S_VERSION" "$cd_mod" "$CONTAINERD_VERSION" "$ETCD_VERSION"
    for m in api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider \
      cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api cri-client \
      cri-streaming csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms kube-aggregator \
      kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics mount-utils \
      pod-security-admission sample-apiserver sample-cli-plugin sample-controller streaming; do
      printf '\tk8s.io/%s => k8s.io/%s %s\n' "$m" "$m" "$K8S_STAGING_VERSION"
    done
    printf '\tgithub.com/containerd/containerd/api => github.com/containerd/containerd/api %s\n)\n' "$cd_api"
  } > "$d/go.mod"
  local minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  local ld="-s -w -X $cd_mod/version.Version=$CONTAINERD_VERSION"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
    ld+=" -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  done
  (cd "$d" && go get . 2>&1 | tail -n 5) || return 1
  (cd "$d" && go build -trimpath -ldflags "$ld" -o "$BIN/dsnap-multicall" .) || return 1
}
multicall_rev="$K8S_VERSION $K8S_STAGING_VERSION containerd-$CONTAINERD_VERSION etcd-$ETCD_VERSION"
multicall_rev+=" src-$(cat "$here"/nodebin/*.go | sha256sum | cut -c1-12) $(go env GOVERSION)"
if stamp_ok multicall "$multicall_rev" && [ -x "$BIN/dsnap-multicall" ]; then
  say "dsnap-multicall cached ($multicall_rev)"
else
  say "building dsnap-multicall: Kubernetes $K8S_VERSION, etcd $ETCD_VERSION, containerd $CONTAINERD_VERSION (first time: ~15 min on 2 cores)"
  build_multicall "$SRC/multicall" || die "building dsnap-multicall failed (see the go output above); the Go module proxy must be reachable"
  stamp multicall "$multicall_rev"
fi
for n in $MULTICALL_NAMES; do ln -sfn dsnap-multicall "$BIN/$n"; done
# What the separate builds left: their stamps and module dirs.
rm -f "$BIN"/.stamp-{k8s,k8s-node,containerd,etcd}
rm -rf "$SRC"/k8s-v* "$SRC"/k8s-node-v* "$SRC"/etcd-*
grep -qx "Kubernetes $K8S_VERSION" <<< "$("$BIN/kube-apiserver" --version)" || die "kube-apiserver --version does not report $K8S_VERSION"
grep -q " $CONTAINERD_VERSION" <<< "$("$BIN/containerd" --version)" || die "containerd --version does not report $CONTAINERD_VERSION"
grep -qx "etcd Version: ${ETCD_VERSION#v}" <<< "$("$BIN/etcd" --version)" || die "etcd --version does not report $ETCD_VERSION"

# ---------------------------------------------------------------- runc and the CNI plugins (Go module proxy)
# Static, so that one build runs here and on a machine with none of their libraries (no libseccomp);
# runc with seccomp filters, as its own `make static` builds it.
if stamp_ok runc "$RUNC_VERSION" && [ -x "$BIN/runc" ]; then
  say "runc $RUNC_VERSION cached"
else
  say "building runc $RUNC_VERSION (static, seccomp)"
  CGO_ENABLED=1 GOBIN=$BIN go install -trimpath -buildmode=pie -tags "seccomp urfave_cli_no_docs netgo osusergo" \
    -ldflags "-s -w -linkmode external -extldflags -static-pie" "github.com/opencontainers/runc@$RUNC_VERSION" \
    || die "building runc $RUNC_VERSION failed (it needs gcc and libseccomp-dev's static library)"
  grep -qx "runc version ${RUNC_VERSION#v}" <<< "$("$BIN/runc" --version)" || die "runc --version does not report $RUNC_VERSION"
  ! grep -q NEEDED <<< "$(readelf -d "$BIN/runc")" || die "runc links shared libraries: $(readelf -d "$BIN/runc" | grep NEEDED)"
  stamp runc "$RUNC_VERSION"
fi
cni_mod=github.com/containernetworking/plugins
if stamp_ok cni "$CNI_PLUGINS_VERSION" && [ -x "$BIN/cni/bridge" ] && [ -x "$BIN/cni/host-local" ] && [ -x "$BIN/cni/loopback" ]; then
  say "CNI plugins $CNI_PLUGINS_VERSION cached"
else
  say "building the CNI bridge, host-local and loopback plugins $CNI_PLUGINS_VERSION"
  mkdir -p "$BIN/cni"
  GOBIN=$BIN/cni go install -trimpath -ldflags "-s -w -X $cni_mod/pkg/utils/buildversion.BuildVersion=$CNI_PLUGINS_VERSION" \
    "$cni_mod/plugins/main/bridge@$CNI_PLUGINS_VERSION" "$cni_mod/plugins/ipam/host-local@$CNI_PLUGINS_VERSION" \
    "$cni_mod/plugins/main/loopback@$CNI_PLUGINS_VERSION" || die "building the CNI plugins $CNI_PLUGINS_VERSION failed"
  stamp cni "$CNI_PLUGINS_VERSION"
fi

go_install() {  # name version module/cmd-path
  local name=$1 version=$2 pkg=$3
  if stamp_ok "$name" "$version" && [ -x "$BIN/$name" ]; then say "$name $version cached"; return; fi
  say "building $name $version"
  GOBIN=$BIN go install -trimpath -ldflags "-s -w $4" "$pkg@$version" || die "building $name $version failed"
  stamp "$name" "$version"
}
go_install kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
# kwok's own stage definitions (fast node start, lease heartbeats, fast pod lifecycle) from its module.
# Not pod-complete: it finishes every Job pod at once, while a checkpoint-source pod must keep running
# until the node agent has checkpointed it.
stages_rev="$KWOK_VERSION-r2"
if stamp_ok kwok-stages "$stages_rev" && [ -s "$BIN/kwok-stages.yaml" ]; then
  say "kwok stages cached"
else
  kdir=$(cd "$SRC" && GOFLAGS= go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  st=$kdir/kustomize/stage
  [ -d "$st" ] || die "kwok $KWOK_VERSION module has no kustomize/stage directory"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-delete.yaml; do
    printf -- '---\n'; cat "$st/$f"
  done > "$BIN/kwok-stages.yaml"
  stamp kwok-stages "$stages_rev"
  say "kwok stages written to $BIN/kwok-stages.yaml"
fi
go_install helm "$HELM_VERSION" helm.sh/helm/v3/cmd/helm "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"

# SeaweedFS, the S3 server of the object-storage tests: `go install` refuses its module (replace directives
# in its go.mod), so it is built inside a copy of the downloaded module (first time: ~4 min on 2 cores).
if stamp_ok weed "$SEAWEEDFS_VERSION" && [ -x "$BIN/weed" ]; then
  say "weed $SEAWEEDFS_VERSION cached"
else
  say "building SeaweedFS weed $SEAWEEDFS_VERSION"
  wdir=$(cd "$SRC" && GOFLAGS= go mod download -json "github.com/seaweedfs/seaweedfs@$SEAWEEDFS_VERSION" \
    | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  [ -d "$wdir" ] || die "downloading github.com/seaweedfs/seaweedfs@$SEAWEEDFS_VERSION failed"
  rm -rf "$SRC/seaweedfs" && cp -r "$wdir" "$SRC/seaweedfs" && chmod -R u+w "$SRC/seaweedfs"
  (cd "$SRC/seaweedfs" && go build -trimpath -ldflags "-s -w" -o "$BIN/weed" ./weed) \
    || die "building SeaweedFS $SEAWEEDFS_VERSION failed"
  rm -rf "$SRC/seaweedfs"
  stamp weed "$SEAWEEDFS_VERSION"
fi

"$BIN/criu" --version | sed -n 1p | sed 's/^/[test-env] /'
"$BIN/etcd" --version | sed -n 1p | sed 's/^/[test-env] /'
say "components ready in $BIN"
