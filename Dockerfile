# Two images from one distribution:
#   docker build --target operator -t omnistage-operator .   (small: no torch)
#   docker build --target engine   -t omnistage-engine .     (vllm + vllm-omni + engine_patches)
FROM python:3.11-slim AS operator
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY engine_patches ./engine_patches
RUN pip install --no-cache-dir . && rm -rf /src
USER 65532:65532
ENTRYPOINT ["omnistage"]
CMD ["run"]

FROM vllm/vllm-openai:v0.30.0 AS engine
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY engine_patches ./engine_patches
# vllm is already in the base image; the engine extra pins vllm-omni to the release the patches target.
RUN pip install --no-cache-dir "vllm-omni==0.30.0" . && rm -rf /src
ENV VLLM_PLUGINS=vllm_omni_register_models,omnistage_engine_patches,omnistage_membership
ENTRYPOINT []
