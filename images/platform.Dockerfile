# The control plane and the operator: loraplex with the [web] and [operator] extras, no torch.
#   docker build -f images/platform.Dockerfile -t ghcr.io/loraplex/platform:0.1.0 .
# The chart runs `loraplex control-plane ...` (web), `loraplex control-plane migrate` (hook Job) and
# `kopf run -m loraplex.operator.main ...` (operator) from this one image.

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

# --- 2: a virtual environment with the wheel and its extras ------------------------------------------------
FROM python:3.11.11-slim-bookworm AS venv
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/loraplex
COPY --from=wheel /dist/ /dist/
# The wheel is this build's own (stage 1), so it has no version to pin.
# hadolint ignore=DL3013
RUN wheel="$(ls /dist/loraplex-*.whl)" && /opt/loraplex/bin/pip install "${wheel}[web,operator]"

# --- 3: runtime: the venv on a clean base, non-root -------------------------------------------------------
FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.source="https://github.com/loraplex/loraplex" \
      org.opencontainers.image.description="loraplex control plane and operator"
ENV PATH=/opt/loraplex/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    LORAPLEX_DATA_DIR=/tmp/loraplex
COPY --from=venv /opt/loraplex /opt/loraplex
# Numeric, so Kubernetes can check runAsNonRoot; the chart sets the same uid.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["loraplex"]
CMD ["control-plane", "--host", "0.0.0.0", "--port", "8080", "--no-migrate"]
