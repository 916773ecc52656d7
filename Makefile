# The README's two commands: `make demo` and `make test`.
VENV ?= $(HOME)/.cache/omnistage/venv
export OMNISTAGE_VENV := $(VENV)
PY := $(VENV)/bin/python

.PHONY: setup test test-unit test-engine test-cluster demo lint crd golden k8s-bins cluster-up cluster-down e2e-kind

setup:
	bash hack/setup.sh

# Every tier that can run here: unit, engine (CPU), cluster (local control plane started by the fixture).
test: setup
	$(PY) -m pytest tests

test-unit: setup
	$(PY) -m pytest tests/unit

test-engine: setup
	$(PY) -m pytest tests/engine

test-cluster: setup
	$(PY) -m pytest tests/cluster

lint: setup
	$(VENV)/bin/ruff check operator engine_patches tests

# Regenerate the committed CRD from the API models.
crd: setup
	$(VENV)/bin/omnistage crd > crds/omnistage.serving.omnistage.io.yaml

# Regenerate the rendering golden files (review the diff before committing).
golden: setup
	OMNISTAGE_UPDATE_GOLDEN=1 $(PY) -m pytest tests/unit/test_render_golden.py -q

# Local control plane for the cluster tests (hack/cluster-up.sh): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and kwok, built from their Go modules into
# ~/.cache/omnistage (the first build takes minutes, later ones are skipped).
k8s-bins:
	bash hack/build-k8s-bins.sh

cluster-up:
	bash hack/cluster-up.sh

cluster-down:
	bash hack/cluster-down.sh

# tests/cluster on a kind cluster with fake H200 GPUs; needs Docker, kind and kubectl (see hack/kind/e2e.sh).
e2e-kind: setup
	PY=$(PY) bash hack/kind/e2e.sh

# The README's first command: setup, local control plane, CRD, stand-in engine runtime and the
# operator in the background, the sample applied and scaled 2 -> 4 -> 1 (hack/demo.sh).
demo:
	OMNISTAGE_VENV=$(VENV) bash hack/demo.sh

# Stop what `make demo` left running: the operator, the stand-in runtime (and its engines), the cluster.
.PHONY: demo-down
demo-down:
	OMNISTAGE_VENV=$(VENV) bash hack/demo.sh down
