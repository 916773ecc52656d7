#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd, kwok and helm from
# their Go modules (no Docker, no release downloads) into a versioned cache outside the repo, and
# copy the third-party CRDs the cluster tier validates against (KEDA's ScaledObject, the Prometheus
# Operator's PodMonitor/ServiceMonitor/PrometheusRule) out of their Go modules next to them.
# Prints the binary directory on its last line. Each piece is skipped when the cached one reports
# the pinned version. `--check` only reports whether the cache is complete.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
# helm.sh/helm/v4: `helm lint` / `helm template` / `helm install` of charts/omnistage-operator.
HELM_VERSION="${HELM_VERSION:-v4.3.1}"
# Modules the CRDs are copied from (only YAML is taken; nothing of them is built or run).
KEDA_VERSION="${KEDA_VERSION:-v2.21.0}"                    # github.com/kedacore/keda/v2
PROM_OPERATOR_VERSION="${PROM_OPERATOR_VERSION:-v0.85.0}"  # github.com/prometheus-operator/prometheus-operator
CACHE_ROOT="${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}"
# The directory name is the cache key: every pinned version is in it, so changing any of them
# lands in a fresh directory (a machine with an older cache, e.g. CI's, rebuilds instead of
# trusting a directory that lacks a piece).
KEY="k8s-bin-$K8S_VERSION-etcd$ETCD_VERSION-kwok$KWOK_VERSION-helm$HELM_VERSION-keda$KEDA_VERSION-promop$PROM_OPERATOR_VERSION"
OUT="${K8S_BIN:-$CACHE_ROOT/$KEY}"
CRD_DIR="$OUT/third-party-crds"
THIRD_PARTY_CRDS=(keda.sh_scaledobjects.yaml monitoring.coreos.com_podmonitors.yaml
                  monitoring.coreos.com_servicemonitors.yaml monitoring.coreos.com_prometheusrules.yaml)

export GOTOOLCHAIN=local     # fail loudly rather than fetch another toolchain
export GOFLAGS=-mod=mod
export CGO_ENABLED=0         # k8s builds its server binaries static too

log() { echo "[build-k8s-bins $(date +%H:%M:%S)] $*" >&2; }

# Capture first: `prog --version | grep -q` lets grep exit early, the program dies of SIGPIPE on
# its next line (etcd prints four) and pipefail turns a match into a miss, i.e. a rebuild.
have_k8s() {
  local b v
  for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do [[ -x "$OUT/$b" ]] || return 1; done
  v="$("$OUT/kube-apiserver" --version 2>/dev/null)" && [[ "$v" == "Kubernetes $K8S_VERSION" ]]
}
have_etcd() {
  local v
  [[ -x "$OUT/etcd" ]] && v="$("$OUT/etcd" --version 2>/dev/null)" && [[ "$v" == *"etcd Version: ${ETCD_VERSION#v}"* ]]
}
have_kwok() {
  local v
  [[ -x "$OUT/kwok" && -d "$OUT/kwok-stages" ]] && v="$("$OUT/kwok" --version 2>/dev/null)" \
    && [[ "$v" == *"kwok version $KWOK_VERSION "* ]]
}
have_helm() {
  local v
  [[ -x "$OUT/helm" ]] && v="$("$OUT/helm" version --template '{{.Version}}' 2>/dev/null)" && [[ "$v" == "$HELM_VERSION" ]]
}
have_crds() {
  local f
  for f in "${THIRD_PARTY_CRDS[@]}"; do [[ -s "$CRD_DIR/$f" ]] || return 1; done
}
cached() { have_k8s && have_etcd && have_kwok && have_helm && have_crds; }

NODE_CMDS=(kubelet kubeadm kube-proxy)
have_node() {
  local b v
  for b in "${NODE_CMDS[@]}"; do
    [[ -x "$1/$b" ]] || return 1
    if [[ $b == kubeadm ]]; then v="$("$1/$b" version -o short 2>/dev/null)"; else v="$("$1/$b" --version 2>/dev/null)"; fi
    [[ "$v" == *"$K8S_VERSION" ]] || return 1
  done
}

# --check: print the binary directory if the cache is complete, else exit 1; never build.
if [[ "${1:-}" == "--check" ]]; then cached && echo "$OUT"; exit; fi

if [[ "${1:-}" != "--node" ]] && cached; then
  log "cached binaries match $K8S_VERSION / etcd $ETCD_VERSION / kwok $KWOK_VERSION / helm $HELM_VERSION"
  echo "$OUT"; exit 0
fi

if [[ "${1:-}" != "--node" ]]; then
  mkdir -p "$OUT"
  # Two pytest sessions (or a session and `make cluster-up`) may both find the cache incomplete:
  # one builds, the other waits for it and then finds everything cached.
  exec 9>"$OUT.lock"
  if ! flock -n 9; then
    log "another build holds $OUT.lock; waiting for it (up to 90 min)"
    flock -w 5400 9 || { log "gave up waiting for $OUT.lock"; exit 1; }
  fi
  if cached; then log "built meanwhile by another process"; echo "$OUT"; exit 0; fi
fi

start=$(date +%s)
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
# Which Go module directory a module@version unpacks to (downloads it when missing).
moddir() {
  (cd "$WORK" && go mod download -json "$1") \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or sys.exit(d.get("Error","no Dir")))'
}

# build_k8s OUTDIR CMD...: k8s.io/kubernetes/cmd/CMD at K8S_VERSION, with the version stamped.
build_k8s() {
  local out=$1; shift
  local minor STAGING_VERSION KMOD m pkg p LDF
  minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  STAGING_VERSION="v0.${K8S_VERSION#v1.}"   # v1.36.3 -> v0.36.3
  # k8s.io/kubernetes maps its staging modules to ./staging/src, which a dependent module cannot
  # see; replace each with its published tag. The list comes from that version's own go.mod.
  log "resolving k8s.io/kubernetes@$K8S_VERSION"
  mkdir -p "$WORK/k8s" && cd "$WORK/k8s"
  go mod init omnistage.invalid/k8sbuild >/dev/null 2>&1
  KMOD="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("GoMod") or sys.exit(d.get("Error","no GoMod")))')"
  local -a STAGING PKGS
  mapfile -t STAGING < <(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\)[[:space:]]*=>[[:space:]]*\./staging/src/.*#\1#p' "$KMOD" | sort -u)
  [[ ${#STAGING[@]} -gt 10 ]] || { echo "could not parse the staging modules from $KMOD" >&2; exit 1; }
  for m in "${STAGING[@]}"; do go mod edit -replace="$m=$m@$STAGING_VERSION"; done
  go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
  PKGS=("${@/#/k8s.io/kubernetes/cmd/}")
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
    go build -trimpath -ldflags "$LDF" -o "$out/" "$pkg"
  done
}

build_etcd() {
  # etcd's server module has relative replaces, so `go install` is refused; as a dependency of a
  # scratch module those replaces are ignored and the published sibling modules are used.
  log "go build etcd $ETCD_VERSION"
  mkdir -p "$WORK/etcd" && cd "$WORK/etcd"
  go mod init omnistage.invalid/etcdbuild >/dev/null 2>&1
  go get -tool "go.etcd.io/etcd/server/v3@$ETCD_VERSION" 2>&1 | tail -n 3 >&2
  go build -trimpath -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCD_VERSION" \
    -o "$OUT/etcd" go.etcd.io/etcd/server/v3
}

build_kwok() {
  log "go install kwok $KWOK_VERSION"
  GOBIN="$OUT" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  # kwok's standalone controller needs Stage objects; the upstream "fast" set ships in its module.
  local dir f
  dir="$(moddir "sigs.k8s.io/kwok@$KWOK_VERSION")"
  mkdir -p "$OUT/kwok-stages"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    install -m 0644 "$dir/kustomize/stage/$f" "$OUT/kwok-stages/"
  done
}

build_helm() {
  # helm's go.mod has no replace directives, so `go install module@version` builds exactly the
  # release's dependency graph. The version variables are what helm's own Makefile sets for a
  # tagged release (metadata empty = no "+unreleased"); helm derives the Kubernetes version it
  # templates against from its client-go module, which the build info carries.
  local t0=$(date +%s) v=helm.sh/helm/v4/internal/version
  log "go install helm $HELM_VERSION (helm.sh/helm/v4/cmd/helm; a few minutes on 2 cores when its modules are not yet compiled)"
  GOBIN="$OUT" go install -trimpath \
    -ldflags "-s -w -X $v.version=$HELM_VERSION -X $v.metadata= -X $v.gitTreeState=clean" \
    "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
  log "helm built in $(( $(date +%s) - t0 ))s"
}

copy_crds() {
  # Real upstream CRDs, so the cluster tier validates the monitors, the alert rules and the KEDA ScaledObject
  # against the schemas a real cluster would use (a module zip is a few MB; nothing is compiled).
  local keda prom
  log "copying third-party CRDs from github.com/kedacore/keda/v2@$KEDA_VERSION and prometheus-operator@$PROM_OPERATOR_VERSION"
  keda="$(moddir "github.com/kedacore/keda/v2@$KEDA_VERSION")"
  prom="$(moddir "github.com/prometheus-operator/prometheus-operator@$PROM_OPERATOR_VERSION")"
  mkdir -p "$CRD_DIR"
  install -m 0644 "$keda/config/crd/bases/keda.sh_scaledobjects.yaml" "$CRD_DIR/"
  install -m 0644 "$prom/example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml" \
    "$prom/example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml" \
    "$prom/example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml" "$CRD_DIR/"
}

if [[ "${1:-}" == "--node" ]]; then
  NODE_OUT="${2:?--node DIR}"; mkdir -p "$NODE_OUT"
  exec 8>"$NODE_OUT/.node-bins.lock"; flock -w 5400 8   # one build at a time; a second finds it cached
  if ! have_node "$NODE_OUT"; then
    build_k8s "$NODE_OUT" "${NODE_CMDS[@]}"
    log "node binaries built in $(( $(date +%s) - start ))s"
    have_node "$NODE_OUT" || { echo "node binaries do not report $K8S_VERSION" >&2; exit 1; }
  fi
  echo "$NODE_OUT"; exit 0
fi

have_k8s || build_k8s "$OUT" kube-apiserver kube-controller-manager kube-scheduler kubectl
have_etcd || build_etcd
have_kwok || build_kwok
have_helm || build_helm
have_crds || copy_crds

# etcd prints four lines: captured first, as in cached() above (`| head -1` killed it with SIGPIPE
# under pipefail, and a cold build with it).
v="$("$OUT/etcd" --version)"; "$OUT/kube-apiserver" --version >&2; echo "${v%%$'\n'*}" >&2
"$OUT/kwok" --version >&2 || true
"$OUT/helm" version --short >&2 || true
log "built in $(( $(date +%s) - start ))s into $OUT"
cached || { echo "built binaries do not report the pinned versions (see above)" >&2; exit 1; }
echo "$OUT"
