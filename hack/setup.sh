#!/usr/bin/env bash
# One virtual environment for everything (operator, engine plugin, tests), outside the repo so a
# fresh clone reuses it. Idempotent: a second run only re-links this checkout (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${OMNISTAGE_VENV:-$HOME/.cache/omnistage/venv}"
log() { echo "[setup $(date +%H:%M:%S)] $*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating virtual environment $VENV"
  python3 -m venv "$VENV"
fi
stamp="$VENV/.omnistage-deps"
# Two distributions, one venv: the operator (pyproject.toml) and the vLLM plugin
# (engine_patches/pyproject.toml), both editable; the operator pins the plugin's version.
want="$(cat pyproject.toml engine_patches/pyproject.toml | sha256sum | cut -c1-16)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  log "installing the project with the engine extra (vllm 0.30.0, vllm-omni 0.30.0, torch 2.13.0: several GB on a cold machine, 5-15 min)"
  start=$(date +%s)
  "$VENV/bin/pip" install --progress-bar off -q --upgrade pip
  "$VENV/bin/pip" install --progress-bar off -e ./engine_patches -e ".[engine,test]"
  echo "$want" > "$stamp"
  log "dependencies installed in $(( $(date +%s) - start ))s; venv size $(du -sh "$VENV" | cut -f1)"
else
  # Dependencies unchanged: only point the editable install at this checkout.
  "$VENV/bin/pip" install --progress-bar off -q --no-deps -e ./engine_patches -e .
fi
log "ready: $VENV"
