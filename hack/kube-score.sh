#!/usr/bin/env bash
# kube-score v1.20.0 on what the project installs and renders, as the 2026-12-01 ecosystem review ran
# it (§3): the kustomize builds (manifests/, the namespaced overlay, monitoring; `helm template` at
# defaults equals the first) and `omnistage render` of the three samples. Prints, per input, the
# CRITICAL and WARNING counts of kube-score's default checks (the review's figures) and of the
# optional seccomp check (judged real there), then every finding left, grouped by check, with the
# project's judgement from hack/kube-score-judged.txt. Exits 1 when a finding is on no line of
# that list: a regression, or a new finding to fix or judge. A developer target (make kube-score),
# not part of CI.
#
#   hack/kube-score.sh [TREE]    TREE: the checkout to score (default: this one); the judged list
#                                is always this checkout's, so an older tree shows what was fixed since.
#
# kube-score is built with `go install` into ~/.cache/omnistage/kube-score-v1.20.0 (skipped when the
# binary there is that version); kubectl comes from hack/build-k8s-bins.sh's cache (make k8s-bins).
set -euo pipefail

KUBE_SCORE_VERSION="${KUBE_SCORE_VERSION:-v1.20.0}"
KUBE_SCORE_MODULE=github.com/zegl/kube-score
K8S_FLOOR=v1.29  # the chart's kubeVersion floor: kube-score's API-version checks judge against it
# The optional check the review judged real (engine pods without a seccomp profile); the other
# optional ones (requests equal to limits) it judged acceptable, so they are left off.
OPTIONAL_CHECKS=container-seccomp-profile
CACHE_ROOT="${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}"
KS_DIR="$CACHE_ROOT/kube-score-$KUBE_SCORE_VERSION"
KS="$KS_DIR/kube-score"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TREE="$(cd "${1:-$HERE}" && pwd)"
PY="${PY:-${OMNISTAGE_VENV:-$CACHE_ROOT/venv}/bin/python}"
SAMPLES=(omnistage.yaml omnistage-production.yaml qwen3-omni-speech.yaml)

log() { echo "[kube-score $(date +%H:%M:%S)] $*" >&2; }

# `go version -m` reads the module version the binary was built from (kube-score's own `version`
# says "development" for a `go install` build). Captured first: see build-k8s-bins.sh on pipefail.
have_kube_score() {
  local v
  [[ -x "$KS" ]] && v="$(go version -m "$KS" 2>/dev/null)" \
    && [[ "$v" == *$'\tmod\t'"$KUBE_SCORE_MODULE"$'\t'"$KUBE_SCORE_VERSION"$'\t'* ]]
}

if have_kube_score; then
  log "kube-score $KUBE_SCORE_VERSION cached: $KS"
else
  log "building $KUBE_SCORE_MODULE/cmd/kube-score@$KUBE_SCORE_VERSION into $KS_DIR (go install; a few minutes on a busy machine)"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  # Into a temporary GOBIN first, so that an interrupted build never leaves a binary that looks cached.
  # One core, lowest priority: the machine is usually running something else.
  (cd "$tmp" && GOTOOLCHAIN=local CGO_ENABLED=0 GOMAXPROCS=1 GOBIN="$tmp/bin" \
     nice -n 19 go install -v "$KUBE_SCORE_MODULE/cmd/kube-score@$KUBE_SCORE_VERSION") 2>&1 \
    | sed 's/^/[kube-score build] /' >&2
  mkdir -p "$KS_DIR" && mv "$tmp/bin/kube-score" "$KS"
  have_kube_score || { log "built $KS, but go version -m does not say $KUBE_SCORE_VERSION"; exit 2; }
  log "built $KS"
fi

K8S_BIN="$(bash "$HERE/hack/build-k8s-bins.sh" --check)" \
  || { log "no cached kubectl: run make k8s-bins (hack/build-k8s-bins.sh) first"; exit 2; }

out="$(mktemp -d)"
trap 'rm -rf "$out" ${tmp:+"$tmp"}' EXIT
log "scoring $TREE ($(git -C "$TREE" log -1 --format='%h %s' 2>/dev/null | cut -c1-70))"

# One rendered file per input, named after what rendered it (/ as +): the report prints that name.
file_of() { echo "$out/${1//\//+}.yaml"; }
inputs=()
for k in manifests manifests/overlays/namespaced manifests/monitoring; do
  inputs+=("kubectl kustomize $k")
  "$K8S_BIN/kubectl" kustomize "$TREE/$k" > "$(file_of "${inputs[-1]}")"
done
for s in "${SAMPLES[@]}"; do
  inputs+=("omnistage render -f manifests/samples/$s")
  # The scored tree's own operator code renders its own samples; a fixed token keeps the output stable.
  PYTHONPATH="$TREE/operator" "$PY" -m omnistage render -f "$TREE/manifests/samples/$s" --token kube-score \
    > "$(file_of "${inputs[-1]}")" 2> "$out/render.err" || { cat "$out/render.err" >&2; exit 2; }
done

# -o json: the findings of -o ci (one per comment) with the check's id and whether it is optional.
# kube-score exits 1 when it found something CRITICAL: that verdict is the report's, not its own.
scored=()
for name in "${inputs[@]}"; do
  f="$(file_of "$name")"
  "$KS" score --kubernetes-version "$K8S_FLOOR" --enable-optional-test "$OPTIONAL_CHECKS" -o json "$f" \
    > "${f%.yaml}.json" || [[ -s "${f%.yaml}.json" ]]
  scored+=("${f%.yaml}.json")
done

echo "kube-score $KUBE_SCORE_VERSION score --kubernetes-version $K8S_FLOOR --enable-optional-test $OPTIONAL_CHECKS" \
  "on $(git -C "$TREE" rev-parse --short HEAD 2>/dev/null || echo "$TREE")"
"$PY" "$HERE/hack/kube-score-report.py" "$HERE/hack/kube-score-judged.txt" "${scored[@]}"
