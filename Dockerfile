# syntax=docker/dockerfile:1
# Two images from this repository, one per distribution:
#   docker build --target operator -t ghcr.io/omnistage/omnistage-operator:0.1.0 .
#       the operator (omnistage-operator, kopf) plus the plugin package for its stdlib-only
#       contract module; no vLLM, no torch.
#   docker build --target engine -t ghcr.io/omnistage/omnistage-engine:0.1.0 .
#       vllm + vllm-omni + the plugin (omnistage-engine-patches) only: no kopf, no operator.
# The tags are what manifests/ and the chart deploy (the operator image, and OMNISTAGE_ENGINE_IMAGE
# for the engine); pass --build-arg VERSION=... --build-arg REVISION=$(git rev-parse HEAD) for a
# release. Checked by hadolint in the unit tier (tests/unit/test_dockerfile.py); nothing here
# builds the image.
#
# Base images are pinned to exact release tags. To update one: pick the new tag, resolve it with
# `docker buildx imagetools inspect <image>:<tag>` (or `crane digest`), optionally append the
# digest as <image>:<tag>@sha256:<digest> to pin it byte for byte, and rebuild both targets. The
# engine base must keep vllm at the version engine_patches/pyproject.toml pins (0.30.0): the
# patches target exactly that release.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.30.0

# ----- operator ------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG PYTHON_IMAGE
LABEL org.opencontainers.image.title="omnistage-operator" \
      org.opencontainers.image.description="Kubernetes operator (kopf) for vllm-omni with a replicated, elastic stage 0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Dependency layer: only the project metadata, so a source change does not reinstall kopf & co.
# The plugin pin (omnistage-engine-patches) is installed from the source below, not from an index.
COPY pyproject.toml ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if not d.startswith('omnistage-')))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY engine_patches ./engine_patches
COPY operator ./operator
RUN pip install --no-cache-dir --no-deps ./engine_patches . \
    && rm -rf /src
WORKDIR /
USER 65532:65532
ENTRYPOINT ["omnistage"]
CMD ["run"]

# ----- engine --------------------------------------------------------------------------------------
FROM ${VLLM_IMAGE} AS engine
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG VLLM_IMAGE
LABEL org.opencontainers.image.title="omnistage-engine" \
      org.opencontainers.image.description="vllm 0.30.0 + vllm-omni 0.30.0 + the omnistage-engine-patches vLLM plugin" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${VLLM_IMAGE}"
WORKDIR /src
# Dependency layer: the plugin's `engine` extra (vllm, already in the base, and vllm-omni), read
# from its pyproject so the pins live in one place.
COPY engine_patches/pyproject.toml ./engine_patches/
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('engine_patches/pyproject.toml', 'rb'))\
['project']['optional-dependencies']['engine']))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY engine_patches ./engine_patches
RUN pip install --no-cache-dir --no-deps ./engine_patches \
    && rm -rf /src
WORKDIR /
# vLLM loads only allow-listed plugins; the operator renders the same list into every engine pod.
ENV VLLM_PLUGINS=vllm_omni_register_models,omnistage_engine_patches,omnistage_membership
# The operator renders the command (`vllm serve ...`); the base image's API-server entrypoint would
# swallow it.
ENTRYPOINT []
