# halfmoon in a container: `docker build -t halfmoon .` then
#   export HALFMOON_API_KEY=$(openssl rand -hex 32)
#   docker run --rm --shm-size=2g -e HALFMOON_API_KEY -p 127.0.0.1:50051:50051 \
#     -p 127.0.0.1:9400:9400 halfmoon
# serves the tiny model on CPU (docs/deploy.md). It binds 0.0.0.0 inside the container, which
# `serve` refuses without an API key. For a GPU image, build on a CUDA base with the
# matching torch wheels and build of Mooncake's Transfer Engine (transfer-cuda13 on CUDA 13):
#   docker build -t halfmoon:cuda --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#     --build-arg TRANSFER_EXTRA=transfer-cuda .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# The extra of pyproject.toml with Mooncake's Transfer Engine, KV between machines (Makefile).
ARG TRANSFER_EXTRA=transfer-cpu
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PATH=/opt/venv/bin:$PATH \
    HALFMOON_CACHE=/opt/halfmoon-cache

# redis-server gives the KV store its Redis tier, g++ builds the CPU kernels on first use
# (kernels/cpu_build.py); the Transfer Engine links libibverbs, libnuma and libcurl even for TCP,
# and its RDMA needs librdmacm and the NICs' drivers (deploy/system-deps.sh); CUDA bases also
# lack Python.
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends redis-server g++ \
       libibverbs1 librdmacm1 ibverbs-providers libnuma1 libcurl4 \
       $(command -v python3 > /dev/null || echo python3 python3-venv) \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, from the index of the base's device (CPU by default), then halfmoon with the
# Transfer Engine's build for that device.
RUN pip install -q --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY . /src/halfmoon
RUN pip install -q "/src/halfmoon[${TRANSFER_EXTRA}]" && rm -rf /src/halfmoon \
    && useradd --create-home halfmoon \
    && halfmoon init-model "${HALFMOON_CACHE}/tiny-llama" \
    && chown -R halfmoon "${HALFMOON_CACHE}"

USER halfmoon
WORKDIR /home/halfmoon
EXPOSE 50051 9400
# Inside the container's own network namespace: publish the ports with -p to reach them. Beyond
# loopback `serve` needs $HALFMOON_API_KEY (docker run -e), or --allow-unauthenticated.
ENTRYPOINT ["halfmoon"]
CMD ["serve", "--host", "0.0.0.0"]
