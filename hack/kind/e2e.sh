#!/usr/bin/env bash
# `make e2e-kind`: the kind tier, everything built here (no registry) and cached under
# ~/.cache/omnistage (hack/kind/build.sh), on one cluster for the whole run:
#   containment (dockerd, the network rule) -> build what is missing -> cluster up -> containment
#   checks -> the operator and CPU engine images (built, checked, kind-loaded) -> tests/cluster/kind
# Prints where the time went. OMNISTAGE_KEEP_CLUSTER=1 keeps the cluster afterwards (a rerun reuses
# it); KIND_CLUSTER names it (default omnistage-e2e). Extra arguments go to pytest.
set -Eeuo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"; ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-python3}"; export KIND_CLUSTER="${KIND_CLUSTER:-omnistage-e2e}"
T0=$(date +%s); STEPS=()
log() { echo "[e2e-kind +$(( $(date +%s) - T0 ))s] $*" >&2; }
step() { local name=$1 t=$(date +%s); shift; log "$name"; "$@"; STEPS+=("$name: $(( $(date +%s) - t ))s"); }
summary() { log "time by step: $(printf '%s; ' "${STEPS[@]}")"; }
trap summary EXIT

[[ $(id -u) == 0 ]] || { log "needs root (dockerd, iptables)"; exit 1; }
step "containment up" bash "$HERE/containment.sh" up
C="$(bash "$HERE/build.sh" | tail -1)"; STEPS+=("build (cached pieces skipped): $(( $(date +%s) - T0 ))s")
B="$C/bin"
step "cluster up" bash "$HERE/up.sh" >/dev/null
KUBECONFIG="${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}/kind-state/kubeconfig"; export KUBECONFIG
[[ "${OMNISTAGE_KEEP_CLUSTER:-0}" == 1 ]] || trap 'bash "$HERE/up.sh" down; summary' EXIT
step "containment checks" bash "$HERE/containment.sh" check omnistage-local/slim:bookworm
step "images" "$PY" "$HERE/images.py" --load "$KIND_CLUSTER" --kind "$B/kind"
cd "$ROOT"
step "tests/cluster/kind" env OMNISTAGE_USE_EXISTING_CLUSTER=1 OMNISTAGE_KIND_CLUSTER="$KIND_CLUSTER" \
  OMNISTAGE_KUBECTL="$B/kubectl" OMNISTAGE_HELM="$B/helm" "$PY" -m pytest tests/cluster/kind --durations=20 "$@"
