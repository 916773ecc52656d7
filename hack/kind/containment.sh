#!/usr/bin/env bash
# The network rule for containers, in one place (make e2e-kind and .ci/run both come through here).
#   containment.sh up      install the packages (docker.io, mmdebstrap) if missing, the runc wrapper and daemon.json, start dockerd, add the DROP rules
#   containment.sh check   prove it holds: host forwarding off, a container's resolver and routes, the
#                          rules in place (prints each check; exits non-zero on the first that fails)
#   containment.sh down    stop the dockerd this script started
# Every bridge, pod and Service range is inside 198.19.0.0/16 (part of 198.18.0.0/15, RFC 2544: not
# routed anywhere), disjoint from the local control plane's 198.18.0.0/16 Service range:
#   docker0 198.19.0.0/24, docker's pool 198.19.128.0/17, the kind network 198.19.1.0/24,
#   kind pods 198.19.16.0/20 (a /24 per node), kind Services 198.19.4.0/22.
# dockerd: ip-forward false (the host never routes a container's packet anywhere), ip-masq false (no
# NAT), dns 127.0.0.1 (a container never gets the host's resolver: nothing listens there).
set -Eeuo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
RANGE=198.19.0.0/16
NO_REGISTRY=http://127.0.0.1:9   # the discard port: nothing listens there
STATE="${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}/kind-state"; mkdir -p "$STATE"
export PATH="/usr/sbin:/usr/bin:$PATH"   # Debian's docker 20.10 CLI before any other on PATH
D=/usr/bin/docker
log() { echo "[containment $(date +%H:%M:%S)] $*" >&2; }

rules() {
  # Anything leaving the range, or entering it from elsewhere, is dropped before docker's own rules.
  iptables -C DOCKER-USER -s "$RANGE" ! -d "$RANGE" -j DROP 2>/dev/null || iptables -I DOCKER-USER -s "$RANGE" ! -d "$RANGE" -j DROP
  iptables -C DOCKER-USER ! -s "$RANGE" -d "$RANGE" -j DROP 2>/dev/null || iptables -I DOCKER-USER ! -s "$RANGE" -d "$RANGE" -j DROP
}

packages() {
  # Debian's docker.io (20.10; no systemd here: dockerd is started below), mmdebstrap for the base
  # images, gcc for pause.c. Installed only when missing.
  command -v dockerd >/dev/null && command -v mmdebstrap >/dev/null && command -v gcc >/dev/null && return
  log "installing docker.io mmdebstrap iptables gcc libc6-dev (Debian packages)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    docker.io mmdebstrap iptables gcc libc6-dev >"$STATE/apt.log" 2>&1 || { tail -20 "$STATE/apt.log" >&2; exit 1; }
}

up() {
  packages
  install -m 755 "$HERE/runc-drop-sys-resource" /usr/local/sbin/runc-drop-sys-resource
  if ! cmp -s "$HERE/daemon.json" /etc/docker/daemon.json 2>/dev/null; then
    install -m 644 -D "$HERE/daemon.json" /etc/docker/daemon.json
    if $D info >/dev/null 2>&1; then
      log "dockerd runs with another daemon.json: stop it first (containment.sh down)"; exit 1
    fi
  fi
  if $D info >/dev/null 2>&1 && [[ "$($D info --format '{{.HTTPSProxy}}')" != "$NO_REGISTRY" ]]; then
    log "a dockerd runs without the loopback registry proxy: stop it first (containment.sh down)"; exit 1
  fi
  if ! $D info >/dev/null 2>&1; then
    # A dockerd that died (the machine reused, a session ended) leaves containerd's pid file; when that
    # pid now names another process, the next dockerd waits for "its" containerd and gives up after 60 s.
    local cpid=/var/run/docker/containerd/containerd.pid
    if [[ -f "$cpid" ]] && ! grep -q containerd "/proc/$(cat "$cpid")/comm" 2>/dev/null; then
      log "removing a stale containerd pid file ($cpid: pid $(cat "$cpid") is no containerd)"; rm -f "$cpid"
    fi
    log "starting dockerd (log $STATE/dockerd.log)"
    # dockerd itself pulls an image it does not have (a FROM, a `docker run`), resolving the registry
    # with the HOST's resolver: every image here is built locally, so its HTTP(S) goes to a proxy on
    # a loopback port where nothing listens (no DNS lookup, no packet off the machine).
    HTTP_PROXY="$NO_REGISTRY" HTTPS_PROXY="$NO_REGISTRY" NO_PROXY="" \
      setsid bash -c 'echo $$ > "$0"; exec dockerd' "$STATE/dockerd.pid" </dev/null >"$STATE/dockerd.log" 2>&1 &
    for _ in $(seq 60); do $D info >/dev/null 2>&1 && break; sleep 1; done
    $D info >/dev/null || { tail -20 "$STATE/dockerd.log" >&2; exit 1; }
  fi
  rules
  log "dockerd up: $($D version --format '{{.Server.Version}}'), default runtime $($D info --format '{{.DefaultRuntime}}')"
}

check() {
  local fail=0 out
  ok() { echo "  ok    $*"; }
  bad() { echo "  FAIL  $*"; fail=1; }
  echo "[containment] checks"
  [[ "$(cat /proc/sys/net/ipv4/ip_forward)" == 0 ]] && ok "host net.ipv4.ip_forward = 0" || bad "host forwards packets"
  $D info --format '{{json .}}' >/dev/null
  for r in "-s $RANGE ! -d $RANGE" "! -s $RANGE -d $RANGE"; do
    # shellcheck disable=SC2086
    iptables -C DOCKER-USER $r -j DROP 2>/dev/null && ok "DOCKER-USER DROP $r" || bad "no DOCKER-USER DROP $r"
  done
  [[ "$(python3 -c 'import json;print(json.load(open("/etc/docker/daemon.json"))["dns"])')" == "['127.0.0.1']" ]] \
    && ok "daemon.json dns [127.0.0.1], ip-masq/ip-forward false" || bad "daemon.json dns is not loopback"
  [[ "$($D info --format '{{.HTTPProxy}} {{.HTTPSProxy}}')" == "$NO_REGISTRY $NO_REGISTRY" ]] \
    && ok "dockerd's registry traffic goes to $NO_REGISTRY (no pull, no DNS lookup off the machine)" || bad "dockerd has no loopback proxy"
  # The proof: a pull of an image nobody built ends at the loopback proxy, before any lookup.
  out="$(timeout 30 $D pull omnistage-local/never-built:none 2>&1 || true)"
  grep -q "proxyconnect tcp: dial tcp 127.0.0.1:9" <<<"$out" && ok "a pull ends at 127.0.0.1:9: $(tail -1 <<<"$out" | cut -c1-90)" \
    || bad "a pull did not end at the loopback proxy: $out"
  local image="${1:-}"
  if [[ -n $image ]]; then
    out="$($D run --rm --network bridge "$image" sh -c 'cat /etc/resolv.conf; echo ---; ip route 2>/dev/null || cat /proc/net/route')"
    grep -q '^nameserver 127.0.0.1$' <<<"$out" && ! grep -v '^nameserver 127.0.0.1$' <<<"$out" | grep -q '^nameserver' \
      && ok "a container's resolver is 127.0.0.1 only" || bad "a container's resolver: $(grep nameserver <<<"$out" | tr '\n' ' ')"
    # The container's default route points at docker0 (198.19.0.1), where the host drops it: no forwarding.
    grep -q 'default via 198.19.0.1' <<<"$out" && ok "a container's default route ends on docker0 (198.19.0.1, not forwarded)" \
      || bad "a container's routes: $(sed -n '/---/,$p' <<<"$out" | tr '\n' ';')"
  fi
  local dropped; dropped="$(iptables -L DOCKER-USER -v -x -n | awk '$3=="DROP"{s+=$1} END{print s+0}')"
  echo "  info  packets dropped by the DOCKER-USER rules so far: $dropped"
  return $fail
}

down() {
  if [[ -s $STATE/dockerd.pid ]]; then
    local p; p=$(<"$STATE/dockerd.pid"); kill "$p" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$p" 2>/dev/null || break; sleep 1; done; rm -f "$STATE/dockerd.pid"
  fi
}

case "${1:-}" in
  up) up ;; check) shift; check "$@" ;; down) down ;;
  *) echo "usage: $0 up|check [IMAGE]|down" >&2; exit 2 ;;
esac
