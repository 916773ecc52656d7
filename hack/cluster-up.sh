#!/usr/bin/env bash
# A real Kubernetes control plane on loopback: etcd, kube-apiserver (RBAC), kube-controller-manager,
# kube-scheduler and kwok (simulated kubelets for the nodes in hack/h200-nodes.yaml), built from
# their Go modules by hack/build-k8s-bins.sh. Processes outlive this script; hack/cluster-down.sh
# stops them. Running it against a healthy cluster of the same state dir reuses that cluster.
#
#   hack/cluster-up.sh          start (or reuse) and wait until every node is Ready
#   hack/cluster-up.sh --check  exit 0 if a healthy cluster of this state dir runs, 1 if not
#
# Network rule (DESIGN.md section 7): everything listens on and dials 127.0.0.1 only.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
D="${OMNISTAGE_CLUSTER_DIR:-/tmp/omnistage-cluster}"
# Non-default ports, so a developer's own cluster or kind on the same host is left alone.
ETCD_PORT="${OMNISTAGE_ETCD_PORT:-23790}"; ETCD_PEER_PORT="${OMNISTAGE_ETCD_PEER_PORT:-23800}"
API_PORT="${OMNISTAGE_API_PORT:-16443}"
KCM_PORT="${OMNISTAGE_KCM_PORT:-20257}"; SCHED_PORT="${OMNISTAGE_SCHED_PORT:-20259}"
# The apiserver insists on a Service CIDR and allocates the `kubernetes` Service's ClusterIP from it.
# Nothing here ever dials a ClusterIP (no kube-proxy, no in-cluster clients), and 198.18.0.0/15 is
# the benchmarking block (RFC 2544): not private, not routed, so a stray dial could reach no one.
SVC_CIDR="${OMNISTAGE_SERVICE_CIDR:-198.18.0.0/16}"
# Pods on nodes without spec.podCIDR get IPs from here (the nodes in h200-nodes.yaml carry their
# own 127.77.N.0/24). Loopback, so a test process can listen on a pod IP.
POD_CIDR="${OMNISTAGE_POD_CIDR:-127.77.0.0/24}"
# The apiserver refuses a loopback advertise address and, bound to loopback, would derive one from
# the default route. It is only advertised: --endpoint-reconciler-type=none keeps it out of the
# `kubernetes` Endpoints and the peer proxy is off, so nothing dials it. TEST-NET-2 (RFC 5737),
# not TEST-NET-1, because this machine's own eth0 sits in TEST-NET-1.
ADVERTISE="${OMNISTAGE_ADVERTISE_ADDRESS:-198.51.100.10}"
# The nodes' own addresses (127.76.0.N) and pod CIDRs (127.77.N.0/24) from hack/h200-nodes.yaml,
# moved to 127.<X>.0.N and 127.<X+1>.N.0/24 when OMNISTAGE_NODE_NET=X is set: two local clusters on
# one machine (two engineers) would otherwise hand the same pod IPs to their engines.
NODE_NET="${OMNISTAGE_NODE_NET:-76}"
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)

KC="$D/admin.kubeconfig"; P="$D/pki"
T0=$(date +%s)
log() { echo "[cluster-up $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" >&2; }

# A pid file only counts if that pid still runs the binary we started (pids get reused).
alive() {
  local f="$D/run/$1.pid" pid
  [[ -f $f ]] || return 1
  pid=$(<"$f")
  [[ -r /proc/$pid/cmdline ]] && [[ "$(tr '\0' ' ' < "/proc/$pid/cmdline")" == *"/$1 "* ]]
}
apiserver_ready() {
  curl -fsS --max-time 5 --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz" >/dev/null 2>&1
}
healthy() {
  local c
  for c in "${COMPONENTS[@]}"; do alive "$c" || return 1; done
  apiserver_ready
}

if [[ "${1:-}" == "--check" ]]; then healthy; exit; fi

# Bounded wait with a progress line every 5 s; on timeout show the logs that explain it.
wait_for() {
  local what=$1 secs=$2 start next=5 waited; shift 2; start=$(date +%s)
  log "waiting for $what (up to ${secs}s)"
  while ! "$@" >/dev/null 2>&1; do
    waited=$(( $(date +%s) - start ))
    local dead="" f
    for f in "$D"/run/*.pid; do [[ -e $f ]] && ! alive "$(basename "$f" .pid)" && dead+=" $(basename "$f" .pid)"; done
    if [[ -n $dead ]] || (( waited >= secs )); then
      if [[ -n $dead ]]; then log "exited while waiting for $what:$dead; last log lines:"
      else log "timed out after ${secs}s waiting for $what; last log lines:"; fi
      for f in "$D"/logs/*.log; do echo "--- $f" >&2; tail -n 25 "$f" >&2; done
      return 1
    fi
    if (( waited >= next )); then log "  still waiting for $what (${waited}s)"; next=$(( waited + 5 )); fi
    sleep 1
  done
  log "$what ready after $(( $(date +%s) - start ))s"
}

BIN="$(bash "$ROOT/hack/build-k8s-bins.sh" | tail -n 1)"
kubectl() { "$BIN/kubectl" --kubeconfig="$KC" "$@"; }

if healthy; then
  log "reusing the running cluster in $D"
else
  if [[ -e "$D" ]]; then
    log "state in $D is not a healthy cluster; stopping what is left of it"
    bash "$ROOT/hack/cluster-down.sh"
  fi
  # Another cluster on our ports would answer our readiness probes and get used by mistake.
  for port in "$ETCD_PORT" "$ETCD_PEER_PORT" "$API_PORT" "$KCM_PORT" "$SCHED_PORT"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      log "127.0.0.1:$port is already in use (another cluster?); choose other OMNISTAGE_*_PORT values"; exit 1
    fi
  done
  mkdir -p "$D"/{pki,logs,run}
  touch "$D/.omnistage-cluster"   # cluster-down.sh only deletes directories carrying this mark
  # A half-started cluster is worse than none: stop it, keep its logs for the reader.
  trap 'log "start-up failed; stopping what was started (logs stay in $D/logs)"; bash "$ROOT/hack/cluster-down.sh" --keep-state' ERR

  log "generating PKI and kubeconfig in $D"
  ossl() { openssl "$@" 2>/dev/null; }
  ossl req -x509 -newkey rsa:2048 -nodes -keyout "$P/ca.key" -out "$P/ca.crt" -days 3650 -subj "/CN=omnistage-local-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1\n' > "$P/server.ext"
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' > "$P/client.ext"
  ossl req -newkey rsa:2048 -nodes -keyout "$P/apiserver.key" -out "$P/apiserver.csr" -subj "/CN=kube-apiserver"
  ossl x509 -req -in "$P/apiserver.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -days 3650 -extfile "$P/server.ext" -out "$P/apiserver.crt"
  # system:masters: one identity for the admin, the controllers, kwok and the tests. RBAC still
  # governs every other identity (tests/cluster/test_api.py::test_rbac_is_enforced).
  ossl req -newkey rsa:2048 -nodes -keyout "$P/admin.key" -out "$P/admin.csr" -subj "/O=system:masters/CN=omnistage-admin"
  ossl x509 -req -in "$P/admin.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -days 3650 -extfile "$P/client.ext" -out "$P/admin.crt"
  ossl genrsa -out "$P/sa.key" 2048; ossl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub"
  b64() { base64 -w0 < "$1"; }
  cat > "$KC" <<KC
apiVersion: v1
kind: Config
clusters:
- name: omnistage-local
  cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority-data: "$(b64 "$P/ca.crt")"}
users:
- name: omnistage-admin
  user: {client-certificate-data: "$(b64 "$P/admin.crt")", client-key-data: "$(b64 "$P/admin.key")"}
contexts:
- name: omnistage-local
  context: {cluster: omnistage-local, user: omnistage-admin}
current-context: omnistage-local
KC

  # setsid: a Ctrl-C in the starting shell must not reach the cluster; own stdio: a caller that
  # captures our output (pytest, make) must not wait for these daemons to close its pipe.
  start() {
    local name=$1; shift
    log "starting $name (log: $D/logs/$name.log)"
    setsid bash -c 'echo $$ > "$0"; exec "$@"' "$D/run/$name.pid" "$@" \
      </dev/null >"$D/logs/$name.log" 2>&1 &
    local i; for i in $(seq 50); do [[ -s "$D/run/$name.pid" ]] && return 0; sleep 0.1; done
    log "$name did not start"; return 1
  }
  https_ok() { curl -fsSk --max-time 5 "https://127.0.0.1:$1/healthz"; }

  start etcd "$BIN/etcd" --name=omnistage --data-dir="$D/etcd-data" \
    --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster="omnistage=http://127.0.0.1:$ETCD_PEER_PORT" --unsafe-no-fsync --log-level=warn
  wait_for etcd 60 curl -fsS --max-time 5 "http://127.0.0.1:$ETCD_PORT/health"

  # The requestheader flags only fill the extension-apiserver-authentication ConfigMap, which the
  # controller manager and scheduler otherwise complain about every few seconds; no certificate
  # with the allowed name is ever issued, so no one can act as a front proxy.
  start kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 --secure-port="$API_PORT" \
    --advertise-address="$ADVERTISE" --endpoint-reconciler-type=none \
    --feature-gates=UnknownVersionInteroperabilityProxy=false \
    --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" \
    --client-ca-file="$P/ca.crt" \
    --requestheader-client-ca-file="$P/ca.crt" --requestheader-allowed-names=omnistage-front-proxy \
    --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
    --service-cluster-ip-range="$SVC_CIDR" \
    --authorization-mode=Node,RBAC --allow-privileged=true \
    --enable-admission-plugins=OwnerReferencesPermissionEnforcement
  # OwnerReferencesPermissionEnforcement (on by default in OpenShift): setting blockOwnerDeletion
  # needs `update` on the owner's finalizers, so the RBAC tests prove the operator's role has it.
  wait_for kube-apiserver 120 apiserver_ready

  # The project's CRDs go in before the controller manager starts: its garbage collector discovers
  # resource types at start and then only every 30 s, so a CRD installed later leaves owned
  # children of deleted OmniStages lingering for ~40 s at first.
  if [[ -f "$ROOT/crds/kustomization.yaml" ]]; then
    log "installing the CRDs in crds/"
    kubectl apply --server-side --field-manager=omnistage-cluster-up -k "$ROOT/crds" >&2
    wait_for "CRDs Established" 60 kubectl wait --for=condition=Established crd --all --timeout=2s
  fi
  # The HPA controller reads metrics every 5 s (upstream's default is 15 s): the HPA test waits for two
  # of its reads, not scaling behaviour this flag changes.
  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig="$KC" --authentication-kubeconfig="$KC" --authorization-kubeconfig="$KC" \
    --bind-address=127.0.0.1 --secure-port="$KCM_PORT" --leader-elect=false \
    --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
    --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" \
    --allocate-node-cidrs=false --controllers='*' \
    --horizontal-pod-autoscaler-sync-period=5s
  start kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig="$KC" --authentication-kubeconfig="$KC" --authorization-kubeconfig="$KC" \
    --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --leader-elect=false
  # Standalone kwok loads its Stages only from --config; the build script ships upstream's "fast" set,
  # and hack/kwok/ replaces those of them a kubelet would contradict (pod-ready.yaml says why).
  # No KwokConfiguration document: kwok applies its option defaults only when there is none
  # (with one, e.g. `options: {}`, it exits on "node leases parallelism must be greater than 0").
  for f in "$BIN"/kwok-stages/*.yaml; do
    own="$ROOT/hack/kwok/$(basename "$f")"
    echo '---'; if [[ -f "$own" ]]; then cat "$own"; else cat "$f"; fi
  done > "$D/kwok.yaml"
  start kwok "$BIN/kwok" --kubeconfig="$KC" --config="$D/kwok.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --cidr="$POD_CIDR" --node-ip=127.0.0.1 --node-lease-duration-seconds=40

  wait_for kube-controller-manager 60 https_ok "$KCM_PORT"
  wait_for kube-scheduler 60 https_ok "$SCHED_PORT"
  # Pods are admitted only once the controller manager made the namespace's default ServiceAccount.
  wait_for "default ServiceAccount (controller manager working)" 60 kubectl -n default get serviceaccount default
fi

log "creating nodes from hack/h200-nodes.yaml"
sed -e "s/127\.76\./127.$NODE_NET./g" -e "s/127\.77\./127.$(( NODE_NET + 1 ))./g" "$ROOT/hack/h200-nodes.yaml" \
  | kubectl apply -f - >&2
wait_for "every node Ready (kwok)" 60 kubectl wait --for=condition=Ready node --all --timeout=2s
gpus="$(kubectl get nodes -l nvidia.com/gpu.product=NVIDIA-H200 -o jsonpath='{range .items[*]}{.status.allocatable.nvidia\.com/gpu} {end}')"
[[ "$gpus" =~ ^(8 ){2,}$ ]] || { log "expected 2+ H200 nodes with 8 allocatable nvidia.com/gpu each, got '$gpus'"; exit 1; }

trap - ERR
kubectl get nodes -o wide >&2
log "cluster up in $D"
echo "export KUBECONFIG=$KC"
