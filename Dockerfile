# The stagemesh services on a CUDA runtime: `docker build -t stagemesh:latest .`, then
# `docker run --gpus all --shm-size=1g stagemesh:latest stage --device cuda ...` (docs/DEPLOY.md).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/stagemesh/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The package with the stage extra (torch from the package index: its CUDA build); one image runs
# every service, though the gateway and the cache service would need only the base install.
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md LICENSE ./
# stagemesh/ links to the service folders beside it; the build follows the links
COPY protos ./protos
COPY gateway ./gateway
COPY stage_service ./stage_service
COPY cache_service ./cache_service
COPY stagemesh ./stagemesh
RUN python3 -m venv /opt/stagemesh \
    && /opt/stagemesh/bin/pip install --upgrade pip \
    && /opt/stagemesh/bin/pip install ".[stage,tracing]" \
    && rm -rf /src

# The uid the Kubernetes manifests run as (runAsUser 10001): the cache root must be its own.
RUN groupadd --gid 10001 stagemesh \
    && useradd --uid 10001 --gid 10001 --home-dir /home/stagemesh --create-home --shell /usr/sbin/nologin stagemesh
USER 10001:10001
WORKDIR /home/stagemesh

# gRPC of the gateway, the stages and the cache service; the gateway's HTTP API (--http-port)
EXPOSE 50051 50061 50062 50070 8000
ENTRYPOINT ["stagemesh"]
CMD ["--help"]
