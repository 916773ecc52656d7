#!/usr/bin/env bash
# Stop the local control plane started by hack/cluster-up.sh and delete its state directory.
# Harmless when nothing runs. --keep-state stops the processes but keeps the directory (logs).
set -uo pipefail

D="${OMNISTAGE_CLUSTER_DIR:-/tmp/omnistage-cluster}"
log() { echo "[cluster-down $(date +%H:%M:%S)] $*" >&2; }
# A zombie (exited, not yet reaped by whoever adopted it) counts as stopped.
running() { [[ -r /proc/$1/stat ]] && ! awk '{exit !($3 == "Z")}' "/proc/$1/stat"; }

if [[ ! -d "$D" ]]; then log "no cluster state in $D; nothing to stop"; exit 0; fi
if [[ ! -e "$D/.omnistage-cluster" ]]; then
  log "$D was not made by hack/cluster-up.sh (no .omnistage-cluster mark); refusing to touch it"; exit 1
fi

# Reverse start order: the clients first, so none of them logs errors about a vanished apiserver.
for c in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
  f="$D/run/$c.pid"; [[ -f $f ]] || continue
  pid=$(<"$f")
  # Only signal the pid if it still runs the binary we started (pids get reused).
  if [[ -r /proc/$pid/cmdline ]] && [[ "$(tr '\0' ' ' < "/proc/$pid/cmdline")" == *"/$c "* ]]; then
    log "stopping $c (pid $pid)"
    kill "$pid" 2>/dev/null
    # The API server spends its graceful shutdown draining watches (past 10 s here, every time); it
    # holds no state of its own (etcd does), so it gets 2 s. The others 10 s.
    grace=10; [[ $c == kube-apiserver ]] && grace=2
    for _ in $(seq $((grace * 5))); do running "$pid" || break; sleep 0.2; done
    if running "$pid"; then log "$c still running ${grace}s after SIGTERM; killing it"; kill -9 "$pid" 2>/dev/null; fi
  fi
  rm -f "$f"
done

if [[ "${1:-}" == "--keep-state" ]]; then log "stopped; state kept in $D"; exit 0; fi
rm -rf "$D"
log "stopped and removed $D"
