#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd and kwok from
# their Go modules (no Docker, no release downloads) into a versioned cache outside the repo.
# Prints the binary directory on its last line. Skips the build when the cached binaries
# report the pinned versions. `--check` only reports whether the cache is complete.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
CACHE_ROOT="${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}"
OUT="${K8S_BIN:-$CACHE_ROOT/k8s-bin-$K8S_VERSION-etcd$ETCD_VERSION-kwok$KWOK_VERSION}"

export GOTOOLCHAIN=local     # fail loudly rather than fetch another toolchain
export GOFLAGS=-mod=mod
export CGO_ENABLED=0         # k8s builds its server binaries static too

log() { echo "[build-k8s-bins $(date +%H:%M:%S)] $*" >&2; }

cached() {
  [[ -x "$OUT/kube-apiserver" && -x "$OUT/kube-controller-manager" && -x "$OUT/kube-scheduler" \
     && -x "$OUT/kubectl" && -x "$OUT/etcd" && -x "$OUT/kwok" && -d "$OUT/kwok-stages" ]] || return 1
  # Capture first: `prog --version | grep -q` lets grep exit early, the program dies of SIGPIPE on
  # its next line (etcd prints four) and pipefail turns a match into a miss, i.e. a rebuild.
  local v
  v="$("$OUT/kube-apiserver" --version 2>/dev/null)" && [[ "$v" == "Kubernetes $K8S_VERSION" ]] || return 1
  v="$("$OUT/etcd" --version 2>/dev/null)" && [[ "$v" == *"etcd Version: ${ETCD_VERSION#v}"* ]] || return 1
  v="$("$OUT/kwok" --version 2>/dev/null)" && [[ "$v" == *"kwok version $KWOK_VERSION "* ]] || return 1
}

# --check: print the binary directory if the cache is complete, else exit 1; never build.
if [[ "${1:-}" == "--check" ]]; then cached && echo "$OUT"; exit; fi

if cached; then
  log "cached binaries match $K8S_VERSION / etcd $ETCD_VERSION / kwok $KWOK_VERSION"
  echo "$OUT"; exit 0
fi

start=$(date +%s)
mkdir -p "$OUT"
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
STAGING_VERSION="v0.${K8S_VERSION#v1.}"   # v1.36.3 -> v0.36.3

# k8s.io/kubernetes maps its staging modules to ./staging/src, which a dependent module cannot
# see; replace each with its published tag. The list comes from that version's own go.mod.
log "resolving k8s.io/kubernetes@$K8S_VERSION"
mkdir -p "$WORK/k8s" && cd "$WORK/k8s"
go mod init omnistage.invalid/k8sbuild >/dev/null 2>&1
KMOD="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
  | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("GoMod") or sys.exit(d.get("Error","no GoMod")))')"
mapfile -t STAGING < <(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\)[[:space:]]*=>[[:space:]]*\./staging/src/.*#\1#p' "$KMOD" | sort -u)
[[ ${#STAGING[@]} -gt 10 ]] || { echo "could not parse the staging modules from $KMOD" >&2; exit 1; }
for m in "${STAGING[@]}"; do go mod edit -replace="$m=$m@$STAGING_VERSION"; done
go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
PKGS=(k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)
log "downloading modules for ${#PKGS[@]} kubernetes commands (${#STAGING[@]} staging replaces)"
go get -tool "${PKGS[@]/%/@$K8S_VERSION}" 2>&1 | tail -n 3 >&2

LDF="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDF+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  LDF+=" -X $p.gitTreeState=clean -X $p.gitCommit=0000000000000000000000000000000000000000"
  LDF+=" -X $p.buildDate=1970-01-01T00:00:00Z"
done
for pkg in "${PKGS[@]}"; do
  log "go build ${pkg##*/} (the first one compiles most of kubernetes; expect many minutes on 2 cores)"
  go build -trimpath -ldflags "$LDF" -o "$OUT/" "$pkg"
done

# etcd's server module has relative replaces, so `go install` is refused; as a dependency of a
# scratch module those replaces are ignored and the published sibling modules are used.
log "go build etcd $ETCD_VERSION"
mkdir -p "$WORK/etcd" && cd "$WORK/etcd"
go mod init omnistage.invalid/etcdbuild >/dev/null 2>&1
go get -tool "go.etcd.io/etcd/server/v3@$ETCD_VERSION" 2>&1 | tail -n 3 >&2
go build -trimpath -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCD_VERSION" \
  -o "$OUT/etcd" go.etcd.io/etcd/server/v3

log "go install kwok $KWOK_VERSION"
GOBIN="$OUT" go install -trimpath \
  -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"

# kwok's standalone controller needs Stage objects; the upstream "fast" set ships in its module.
KWOK_DIR="$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
mkdir -p "$OUT/kwok-stages"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  install -m 0644 "$KWOK_DIR/kustomize/stage/$f" "$OUT/kwok-stages/"
done

"$OUT/kube-apiserver" --version >&2; "$OUT/etcd" --version | head -1 >&2; "$OUT/kwok" --version >&2 || true
log "built in $(( $(date +%s) - start ))s into $OUT"
cached || { echo "built binaries do not report the pinned versions (see above)" >&2; exit 1; }
echo "$OUT"
