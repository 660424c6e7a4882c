# syntax=docker/dockerfile:1
# kvflow image: router, prefill worker and decode worker (one image, the chart picks the role).
#
# GPU (default):  docker build -t kvflow:0.1.0 .
# CPU variant:    docker build -t kvflow:0.1.0-cpu \
#                   --build-arg BASE_IMAGE=ubuntu:22.04 \
#                   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# Both stages share BASE_IMAGE so the virtualenv built in the first one runs on
# the very same Python in the second.

ARG BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04

FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" .

FROM ${BASE_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kvflow \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kvflow \
       --shell /usr/sbin/nologin kvflow
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/kvflow \
    KVFLOW_CACHE=/home/kvflow/.cache/kvflow
WORKDIR /home/kvflow
USER 10001:10001
# router HTTP, router gRPC, prefill gRPC, decode gRPC, worker metrics
EXPOSE 8000 50051 50061 50071 9100
ENTRYPOINT ["kvflow"]
CMD ["--help"]
