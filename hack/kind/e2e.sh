#!/usr/bin/env bash
# `make e2e-kind`: run tests/cluster against a kind cluster instead of the local control plane.
# Needs Docker, kind and kubectl on PATH (not available on the project's CI machines, which is why
# the default tier uses hack/cluster-up.sh). The GPUs are fake: each H200 worker's node status
# gets 8 nvidia.com/gpu, which the scheduler honours like a device plugin's.
#   KIND_CLUSTER (default omnistage-e2e)   OMNISTAGE_KEEP_CLUSTER=1 keeps the cluster afterwards
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
NAME="${KIND_CLUSTER:-omnistage-e2e}"
PY="${PY:-python3}"
KUBECONFIG="$(mktemp -d)/kubeconfig"; export KUBECONFIG
log() { echo "[e2e-kind $(date +%H:%M:%S)] $*" >&2; }

for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { log "$tool not found on PATH; e2e-kind needs Docker, kind and kubectl"; exit 1; }
done

log "creating kind cluster $NAME (kubeconfig $KUBECONFIG)"
kind create cluster --name "$NAME" --config "$ROOT/hack/kind/cluster.yaml" --kubeconfig "$KUBECONFIG" --wait 180s
[[ "${OMNISTAGE_KEEP_CLUSTER:-0}" == 1 ]] || trap 'log "deleting kind cluster $NAME"; kind delete cluster --name "$NAME"' EXIT

for node in $(kubectl get nodes -l nvidia.com/gpu.product=NVIDIA-H200 -o name); do
  log "advertising 8 fake nvidia.com/gpu on $node"
  # The kubelet keeps extended resources it does not manage, so the patch sticks.
  kubectl patch "$node" --subresource=status --type=merge \
    -p '{"status":{"capacity":{"nvidia.com/gpu":"8"},"allocatable":{"nvidia.com/gpu":"8"}}}'
done

log "running tests/cluster against kind"
cd "$ROOT"
OMNISTAGE_USE_EXISTING_CLUSTER=1 OMNISTAGE_KUBECTL="$(command -v kubectl)" \
  "$PY" -m pytest tests/cluster "$@"
