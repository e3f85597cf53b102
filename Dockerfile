# syntax=docker/dockerfile:1
# The admission service's image: `extproc` (and `python`, for the chart's preStop hook) on PATH,
# running as an unprivileged user, with nothing in it but Python, the service's wheel and the
# wheels it depends on. The Helm chart's default `image` is this image as published by
# .github/workflows/image.yml; build it yourself with `make image` (docker, podman or buildah,
# whichever is present; docs/deployment/image.md), or by hand:
#   docker build -t llm-admission:0.1.0 .
#   buildah bud --pull=never --build-arg PYTHON_IMAGE=<a local base> -t llm-admission:0.1.0 .
# Envoy runs from its own image (envoyproxy/envoy) next to it.

# Pinned base: the Python line the service is tested on, on Debian 12. CI may add the digest;
# --build-arg PYTHON_IMAGE=... names another (a local copy, a mirror) of the same Python line.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# Only what the service's wheel is made of (pyproject packages extproc/ alone; the simulator, the
# benchmarks and devstack are tools of the checkout and never ship).
COPY pyproject.toml README.md ./
COPY extproc ./extproc
RUN python -m venv /opt/llm-admission \
 && /opt/llm-admission/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/llm-admission/bin/pip install --no-compile /wheels/llm_admission-*.whl \
 && /opt/llm-admission/bin/python -m compileall -q /opt/llm-admission/lib \
 && /opt/llm-admission/bin/pip uninstall -y pip

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="llm-admission" \
      org.opencontainers.image.description="Admission control for vLLM as an Envoy ext_proc service"
ENV PATH=/opt/llm-admission/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    EXTPROC_LISTEN=0.0.0.0:9002 \
    EXTPROC_PROBE_LISTEN=0.0.0.0:9004
# gRPC for Envoy on 9002; /metrics, /healthz, /readyz for probes and scrapes on 9004. The full admin
# interface (status page, /debug/*) stays on 127.0.0.1:9003 inside the container (unauthenticated).
COPY --from=build /opt/llm-admission /opt/llm-admission
# The chart runs the service as 10001:10001 with a read-only root filesystem.
USER 10001:10001
EXPOSE 9002 9004
HEALTHCHECK --interval=10s --timeout=2s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9003/healthz', timeout=1).status != 200)"]
CMD ["extproc", "serve"]
