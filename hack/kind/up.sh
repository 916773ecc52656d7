#!/usr/bin/env bash
# Bring up (or reuse) the kind cluster of `make e2e-kind` from the images hack/kind/build.sh made:
#   up.sh      create it (if missing), wire the pod network, advertise the fake GPUs, wait for Ready
#   up.sh down delete it and the kind network
# Pod network: kindnetd cannot be built here, so each node gets the bridge CNI with its own /24
# (node i: 198.19.(16+i).0/24, pods route only 198.19.0.0/16: no default route) and a route to
# every other node's /24 via that node's address on the kind network (one L2 bridge on the host;
# forwarding is switched on inside the node containers only, never on the host).
# The engine environment (the CPU venv, its interpreter, the tiny models) is mounted read-only into
# the workers from the host's cache (docs/design.md section 6, the kind tier; hack/kind/images.py).
# A cluster made before a mount was added lacks it: `up.sh down` and up again.
# Writes the kubeconfig to $STATE/kubeconfig; prints it on the last line.
set -Eeuo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
if [[ "${1:-}" == down ]]; then C="$(bash "$HERE/build.sh" --path)"; else C="$(bash "$HERE/build.sh" | tail -1)"; fi
B="$C/bin"; NAME="${KIND_CLUSTER:-omnistage-e2e}"
CACHE="${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}"; STATE="$CACHE/kind-state"; mkdir -p "$STATE"
KUBECONFIG_OUT="$STATE/kubeconfig"
KIND_SHM="/dev/shm/omnistage-kind-$NAME"   # the workers' /dev/shm/omnistage (below)
export PATH="/usr/sbin:/usr/bin:$PATH"; D=/usr/bin/docker
T0=$(date +%s); log() { echo "[kind-up +$(( $(date +%s) - T0 ))s] $*" >&2; }
K() { "$B/kubectl" --kubeconfig "$KUBECONFIG_OUT" "$@"; }

if [[ "${1:-}" == down ]]; then
  [[ -x $B/kind ]] && "$B/kind" delete cluster --name "$NAME" >/dev/null 2>&1 || true
  $D network rm kind >/dev/null 2>&1 || true
  rm -rf "$KIND_SHM"
  log "cluster $NAME deleted"; exit 0
fi

# What the engine pods mount from the host (same path in node and pod; the CPU image expects them).
VENV="${OMNISTAGE_CPU_VENV:-$CACHE/venv-cpu}"; MODEL="${OMNISTAGE_TINY_MODEL:-$CACHE/tiny-omni}"
SPEECH_MODEL="${OMNISTAGE_TINY_SPEECH_MODEL:-$CACHE/tiny-qwen3-omni}"   # tests/cluster/real/realstage.py
PYHOME="$(sed -n 's/^home = //p' "$VENV/pyvenv.cfg")"; PYPREFIX="$(dirname "$PYHOME")"
for p in "$VENV/bin/python" "$MODEL/config.json" "$SPEECH_MODEL/config.json" "$PYHOME"; do
  [[ -e $p ]] || { log "missing $p: run make real-engine-env first"; exit 1; }
done

if ! "$B/kind" get clusters 2>/dev/null | grep -qx "$NAME"; then
  $D network inspect kind >/dev/null 2>&1 || $D network create --driver bridge --subnet 198.19.1.0/24 --gateway 198.19.1.1 \
    -o com.docker.network.bridge.enable_ip_masquerade=false -o com.docker.network.bridge.name=br-kind198 kind >/dev/null
  cfg="$STATE/kind-config.yaml"; : > "$cfg"; i=0
  while IFS= read -r line; do
    echo "$line" >> "$cfg"
    if [[ $line =~ ^-\ role: ]]; then
      conf="$STATE/cni-node$i.conflist"
      cat > "$conf" <<CNI
{"cniVersion": "0.4.0", "name": "bridge", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "198.19.$((16 + i)).0/24"}]], "routes": [{"dst": "198.19.0.0/16"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
CNI
      { echo "  extraMounts:"
        echo "  - {hostPath: $conf, containerPath: /etc/cni/net.d/10-bridge.conflist, readOnly: true}"
        if [[ $line != *control-plane* ]]; then
          echo "  - {hostPath: $VENV, containerPath: /opt/omnistage-engine, readOnly: true}"
          echo "  - {hostPath: $PYPREFIX, containerPath: $PYPREFIX, readOnly: true}"
          # tests/cluster/kind/kindstage.py: MODEL_DIR, SPEECH_MODEL_DIR
          echo "  - {hostPath: $MODEL, containerPath: /opt/omnistage-models/tiny-omni, readOnly: true}"
          echo "  - {hostPath: $SPEECH_MODEL, containerPath: /opt/omnistage-models/tiny-qwen3-omni, readOnly: true}"
          # transport sameNode mounts the node's /dev/shm/omnistage (render/pods.py SAME_NODE_SHM_ROOT) as
          # the pods' /dev/shm; a kind node's own /dev/shm is docker's 64 MB tmpfs, below vLLM's 160 MB
          # message queues: a directory of the host's /dev/shm per worker, as a GPU node's would be.
          mkdir -p "$KIND_SHM/node$i"
          echo "  - {hostPath: $KIND_SHM/node$i, containerPath: /dev/shm/omnistage}"
        fi; } >> "$cfg"
      i=$((i + 1))
    fi
  done < <(grep -v '^ *#' "$HERE/cluster.yaml")
  log "creating cluster $NAME ($i nodes, node image $("$B/kind" version 2>/dev/null | cut -d' ' -f2))"
  "$B/kind" create cluster --name "$NAME" --image "omnistage-local/kind-node:v1.36.3" --config "$cfg" \
    --kubeconfig "$KUBECONFIG_OUT" --wait 0s >"$STATE/create.log" 2>&1 || { tail -30 "$STATE/create.log" >&2; exit 1; }
fi
"$B/kind" get kubeconfig --name "$NAME" > "$KUBECONFIG_OUT"

log "pod network: a route per node to every other node's pod /24"
mapfile -t NODES < <($D ps --filter "label=io.x-k8s.kind.cluster=$NAME" --format '{{.Names}}' | sort)
declare -A IP SUBNET
for n in "${NODES[@]}"; do
  IP[$n]="$($D inspect -f '{{(index .NetworkSettings.Networks "kind").IPAddress}}' "$n")"
  SUBNET[$n]="$($D exec "$n" sh -c 'grep -o "198\.19\.[0-9]*\.0/24" /etc/cni/net.d/10-bridge.conflist')"
done
for n in "${NODES[@]}"; do
  $D exec "$n" sysctl -qw net.ipv4.ip_forward=1   # the node's own netns, not the host's
  for m in "${NODES[@]}"; do
    [[ $n == "$m" ]] || $D exec "$n" ip route replace "${SUBNET[$m]}" via "${IP[$m]}"
  done
done
K wait --for=condition=Ready node --all --timeout=300s >/dev/null
# Their images are placeholders (build.sh): no cluster DNS (the tiers use IPs; a lookup fails at once,
# the kube-dns Service has no endpoints) and no PVC provisioner.
K -n kube-system scale deployment coredns --replicas=0 >/dev/null
K -n local-path-storage scale deployment local-path-provisioner --replicas=0 >/dev/null
for node in $(K get nodes -l nvidia.com/gpu.product=NVIDIA-H200 -o name); do
  # The kubelet keeps extended resources it does not manage, so the patch sticks.
  K patch "$node" --subresource=status --type=merge \
    -p '{"status":{"capacity":{"nvidia.com/gpu":"8"},"allocatable":{"nvidia.com/gpu":"8"}}}' >/dev/null
done
log "nodes Ready: $(K get nodes --no-headers | awk '{print $1"="$2}' | tr '\n' ' ')"
echo "$KUBECONFIG_OUT"
