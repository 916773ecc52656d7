#!/usr/bin/env bash
# Build, with no container registry, everything a kind cluster needs here, into the cache
# ($OMNISTAGE_CACHE/kind-<versions>; each piece is skipped when present):
#   bin/      kind, crictl (Go modules), kubelet/kubeadm/kube-proxy (hack/build-k8s-bins.sh --node),
#             the control plane's binaries (hack/build-k8s-bins.sh), pause (kubernetes' pause.c)
#   rootfs/   two Debian bookworm trees from mmdebstrap: the node (systemd, containerd 1.6, runc, CNI
#             plugins, kind's own files), "slim" (iptables, conntrack, python3 + pip: the base of
#             kube-proxy and the operator image) and "engine" (slim + torch's and opencv's libraries)
#   release/  the component images and kubelet/kubeadm/kubectl as the release archive
#             `kind build node-image --type file` reads (extra images ride in kube-proxy.tar)
# and the docker images omnistage-local/{kind-base,slim,engine}:bookworm and omnistage-local/kind-node:<k8s>.
# Prints where the time went. Needs the containment's dockerd (containment.sh up).
set -Eeuo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"; ROOT="$(cd "$HERE/../.." && pwd)"
KIND_VERSION=v0.33.0; K8S_VERSION=v1.36.3; CRICTL_VERSION=v1.37.0
C="${OMNISTAGE_KIND_CACHE:-${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}/kind-$KIND_VERSION-k8s-$K8S_VERSION}"
B="$C/bin"; L="$C/log"; mkdir -p "$B" "$L" "$C/rootfs"
NODE_IMAGE="omnistage-local/kind-node:$K8S_VERSION"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
export GOTOOLCHAIN=local CGO_ENABLED=0 PATH="/usr/sbin:/usr/bin:$PATH" DOCKER_BUILDKIT=0
D=/usr/bin/docker
T0=$(date +%s); : > "$L/times"
log() { echo "[kind-build +$(( $(date +%s) - T0 ))s] $*" >&2; }
# timed NAME CMD...: run, log and keep its duration for the summary (output in $L/NAME.log)
timed() {
  local name=$1 t=$(date +%s) rc=0; shift
  log "$name ..."
  # In the background and waited for: bash ignores `set -e` inside a function run as an `if` or `||`
  # condition, so a failed step would pass as done.
  "$@" >"$L/$name.log" 2>&1 & wait $! || rc=$?
  if [[ $rc != 0 ]]; then log "$name FAILED ($rc); last lines of $L/$name.log:"; tail -25 "$L/$name.log" >&2; return 1; fi
  echo "$name $(( $(date +%s) - t ))s" >> "$L/times"; log "$name done in $(( $(date +%s) - t ))s"
}
have_image() { $D image inspect "$1" >/dev/null 2>&1; }

go_tools() {
  [[ -x $B/kind ]] || GOBIN="$B" nice -n 10 go install "sigs.k8s.io/kind@$KIND_VERSION"
  [[ -x $B/crictl ]] || GOBIN="$B" nice -n 10 go install -trimpath -ldflags '-s -w' "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
}
node_bins() { nice -n 10 bash "$ROOT/hack/build-k8s-bins.sh" --node "$B"; }
control_plane_bins() {
  local kb; kb="$(bash "$ROOT/hack/build-k8s-bins.sh" | tail -1)"
  for b in kube-apiserver kube-controller-manager kube-scheduler kubectl etcd helm; do cp -f "$kb/$b" "$B/"; done
}
pause_bin() {
  [[ -x $B/pause ]] || gcc -Os -static -DVERSION=v3.10-omnistage -o "$B/pause" \
    "$(go env GOMODCACHE)/k8s.io/kubernetes@$K8S_VERSION/build/pause/linux/pause.c"
}

# The node's rootfs: what kindest/base holds, from Debian's packages (containerd 1.6.20, runc 1.1.5,
# CNI plugins 1.1.1) plus kind's own files (entrypoint, units, containerd config) from its module.
node_rootfs() {
  [[ -s $C/rootfs/kind-base.tar ]] && return
  local files="$C/rootfs/kind-files"
  rm -rf "$files"; cp -r "$(go env GOMODCACHE)/sigs.k8s.io/kind@$KIND_VERSION/images/base/files" "$files"; chmod -R u+w "$files"
  # No CAP_SYS_RESOURCE here: no process may lower its oom_score_adj, and unrestricted runc fails
  # every pod sandbox ("can't get final child's PID from pipe").
  sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' "$files/etc/containerd/config.toml"
  grep -q 'restrict_oom_score_adj = true' "$files/etc/containerd/config.toml"
  nice -n 10 mmdebstrap --variant=minbase --format=tar \
    --include=systemd,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,fuse-overlayfs,e2fsprogs,bash,ca-certificates,curl,jq,procps,containerd,runc,containernetworking-plugins \
    --customize-hook='tar -C '"$files"' -cf - . | tar -C "$1" -xf - --no-same-owner' \
    --customize-hook='chmod 0755 "$1"/usr/local/bin/* "$1"/kind "$1"/kind/bin "$1"/kind/bin/*' \
    --customize-hook='chroot "$1" sh -euc "
      find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete
      rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* /lib/systemd/system/local-fs.target.wants/*
      rm -f /lib/systemd/system/sockets.target.wants/*udev* /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/*
      echo ReadKMsg=no >> /etc/systemd/journald.conf
      ln -sf /usr/lib/systemd/systemd /sbin/init
      ln -sf /usr/bin/containerd /usr/local/bin/containerd
      ln -sf /usr/bin/ctr /usr/local/bin/ctr
      ln -sf /usr/bin/containerd-shim-runc-v2 /usr/local/bin/containerd-shim-runc-v2
      mkdir -p /usr/local/sbin && ln -sf /usr/sbin/runc /usr/local/sbin/runc
      systemctl enable kubelet.service containerd.service undo-mount-hacks.service
      systemctl mask systemd-binfmt.service
      mkdir -p /etc/kubernetes/manifests /opt/cni/bin
      for p in host-local loopback ptp portmap bridge; do cp /usr/lib/cni/\$p /opt/cni/bin/; done
      ctr oci spec | jq \".hooks.createContainer[.hooks.createContainer| length] |= . + {\\\"path\\\": \\\"/kind/bin/mount-product-files.sh\\\"}\" | jq \"del(.process.rlimits)\" > /etc/containerd/cri-base.json
      test -s /etc/containerd/cri-base.json
      rm -rf /var/lib/apt/lists/* /var/cache/apt/* /usr/share/doc/* /usr/share/man/* /var/log/*
    "' \
    bookworm "$C/rootfs/kind-base.tar.part" "$MIRROR"
  mv "$C/rootfs/kind-base.tar.part" "$C/rootfs/kind-base.tar"
}

# "slim": kube-proxy's base, and python3 + pip for the operator image (Debian's python3.11 stands in
# for python:3.11-slim-bookworm; EXTERNALLY-MANAGED removed: the image is the environment).
SLIM_PKGS=iptables,nftables,conntrack,iproute2,ca-certificates,netcat-openbsd,curl,procps,python3,python3-pip,python-is-python3
# "engine": slim plus the shared libraries torch, vLLM's CPU backend and opencv (pulled in by
# vllm-omni's image processors) load: the CPU engine image's base (hack/kind/images.py).
ENGINE_PKGS=$SLIM_PKGS,libgomp1,libnuma1,libxcb1,libgl1,libglib2.0-0,libx11-6,libxext6,libsm6,libice6
# debian_rootfs NAME PACKAGES: a minbase tree, cached under a name that carries the package list's hash
# (a changed list builds a new one).
debian_rootfs() {
  local out; out="$C/rootfs/$1-$(echo "$2" | sha256sum | cut -c1-10).tar"
  [[ -s $out ]] && return
  nice -n 10 mmdebstrap --variant=minbase --format=tar --include="$2" \
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED; rm -rf "$1"/var/lib/apt/lists/* "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
    bookworm "$out.part" "$MIRROR"
  mv "$out.part" "$out"
}
# import_rootfs NAME PACKAGES: omnistage-local/NAME:bookworm from that tree, re-imported when the hash changed.
import_rootfs() {
  local key; key="$(echo "$2" | sha256sum | cut -c1-10)"
  [[ "$($D image inspect -f '{{index .Config.Labels "omnistage.rootfs"}}' "omnistage-local/$1:bookworm" 2>/dev/null)" == "$key" ]] \
    || $D import -c "LABEL omnistage.rootfs=$key" "$C/rootfs/$1-$key.tar" "omnistage-local/$1:bookworm"
}

base_images() {
  import_rootfs slim "$SLIM_PKGS"; import_rootfs engine "$ENGINE_PKGS"
  if ! have_image omnistage-local/kind-base:bookworm; then
    have_image omnistage-local/kind-base-rootfs:bookworm || $D import "$C/rootfs/kind-base.tar" omnistage-local/kind-base-rootfs:bookworm
    local ctx; ctx="$(mktemp -d)"
    cp "$B/crictl" "$HERE/ctr-compat" "$ctx/"; cp "$C/rootfs/kind-files/etc/containerd/config.toml" "$ctx/"
    # /usr/local/bin/ctr is a symlink to /usr/bin/ctr (a COPY onto it would overwrite ctr itself):
    # the shim goes to /usr/local/sbin, first on PATH.
    cat > "$ctx/Dockerfile" <<'DF'
FROM omnistage-local/kind-base-rootfs:bookworm
COPY crictl /usr/local/bin/crictl
COPY ctr-compat /usr/local/sbin/ctr
COPY config.toml /etc/containerd/config.toml
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]
DF
    $D build -q -t omnistage-local/kind-base:bookworm "$ctx"; rm -rf "$ctx"
  fi
}

# One image per component, FROM scratch (static Go binaries) or slim (kube-proxy needs iptables);
# kind's CNI/storage images are placeholders (the bridge CNI of up.sh needs no kindnetd; nothing here
# uses PVCs); CoreDNS is a placeholder too: the tiers use IPs, never cluster DNS.
image_from() {  # image_from TAG BASE BINARY [ENTRYPOINT]
  local ctx; ctx="$(mktemp -d)"; cp "$3" "$ctx/"
  printf 'FROM %s\nCOPY %s /usr/local/bin/\nENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nENTRYPOINT ["/usr/local/bin/%s"]\n' \
    "$2" "$(basename "$3")" "${4:-$(basename "$3")}" > "$ctx/Dockerfile"
  $D build -q -t "$1" "$ctx" >/dev/null; rm -rf "$ctx"
}
release() {
  local R="$C/release"; [[ -s $R/kubernetes-server-linux-amd64.tar.gz ]] && return
  rm -rf "$R"; mkdir -p "$R"
  local -a req extra; local r n
  mapfile -t req < <("$B/kubeadm" config images list --kubernetes-version "$K8S_VERSION" | grep -v pause)
  # kind v0.33.0's own images (their tags are fixed in kind) and kind's pause.
  req+=(registry.k8s.io/pause:3.10 docker.io/kindest/kindnetd:v20260820-69b56db7
        docker.io/kindest/local-path-provisioner:v20260820-69b56db7 docker.io/kindest/local-path-helper:v20260131-7181c60a)
  for r in "${req[@]}"; do
    n=${r##*/}; n=${n%%:*}
    case $n in
      kube-apiserver|kube-controller-manager|kube-scheduler|etcd|pause) image_from "$r" scratch "$B/$n" ;;
      kube-proxy) image_from "$r" omnistage-local/slim:bookworm "$B/kube-proxy" ;;
      coredns|kindnetd|local-path-provisioner) image_from "$r" scratch "$B/pause" ;;   # placeholders
      local-path-helper) $D tag omnistage-local/slim:bookworm "$r" ;;
      *) echo "no recipe for $r" >&2; return 1 ;;
    esac
    echo "built $r"
    case $n in kube-apiserver|kube-controller-manager|kube-scheduler) ;; *) extra+=("$r") ;; esac
  done
  local S="$R/kubernetes/server/bin"; mkdir -p "$S"; echo "$K8S_VERSION" > "$R/kubernetes/version"
  cp "$B/kubelet" "$B/kubeadm" "$B/kubectl" "$S/"
  for n in kube-apiserver kube-controller-manager kube-scheduler; do $D save -o "$S/$n.tar" "registry.k8s.io/$n:$K8S_VERSION"; done
  $D save -o "$S/kube-proxy.short.tar" "${extra[@]}"
  python3 "$HERE/release_archive.py" "$S/kube-proxy.short.tar" "$S/kube-proxy.tar"; rm "$S/kube-proxy.short.tar"
  tar -C "$R" -cf - kubernetes | gzip -1 > "$R/kubernetes-server-linux-amd64.tar.gz.part"
  mv "$R/kubernetes-server-linux-amd64.tar.gz.part" "$R/kubernetes-server-linux-amd64.tar.gz"; rm -rf "$R/kubernetes"
}
node_image() {
  have_image "$NODE_IMAGE" || nice -n 10 "$B/kind" build node-image --type file \
    --base-image omnistage-local/kind-base:bookworm --image "$NODE_IMAGE" "$C/release/kubernetes-server-linux-amd64.tar.gz"
}

[[ "${1:-}" == --path ]] && { echo "$C"; exit 0; }
$D info >/dev/null 2>&1 || { echo "no dockerd: run hack/kind/containment.sh up first" >&2; exit 1; }
if have_image "$NODE_IMAGE" && have_image omnistage-local/slim:bookworm && have_image omnistage-local/engine:bookworm \
    && [[ -s $C/rootfs/engine-$(echo "$ENGINE_PKGS" | sha256sum | cut -c1-10).tar ]] && [[ -x $B/kind && -x $B/helm && -x $B/kubectl ]]; then
  log "cached: $NODE_IMAGE, omnistage-local/slim:bookworm, $B"; echo "$C"; exit 0
fi
# Downloads and dpkg (the two rootfs) beside the compiles (Go tools, node binaries): no shared cache.
# kind's module (go_tools) must be there before the node rootfs copies its files from it.
timed slim-rootfs debian_rootfs slim "$SLIM_PKGS" & P1=$!
timed engine-rootfs debian_rootfs engine "$ENGINE_PKGS" & P3=$!
timed go-tools go_tools
timed node-rootfs node_rootfs & P2=$!
timed control-plane-bins control_plane_bins
timed node-bins node_bins
timed pause pause_bin
wait $P1; wait $P2; wait $P3
timed base-images base_images
timed release release
timed node-image node_image
log "time by step (the two rootfs ran beside the compiles): $(tr '\n' ' ' < "$L/times")"
$D images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'omnistage-local/(kind-node|kind-base|slim|engine)' >&2
echo "$C"
