# syntax=docker/dockerfile:1
# One image for every AMPD service (coordinator, prefill, decode, sidecar). Each docker-compose
# service picks its process with its own `command` (`python -m services.<name> ...`).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NIXL_LOG_LEVEL=WARN

WORKDIR /app

# Pinned dependencies first, in their own layer, installed exactly as the Makefile does:
# nixl lists torch as a dependency, so it goes in with --no-deps (keeps the multi-GB CUDA torch out).
COPY requirements.txt requirements-nixl.txt ./
RUN pip install -r requirements.txt \
 && pip install --no-deps -r requirements-nixl.txt

# The code, then the package itself (again without dependencies: they are pinned above).
COPY pyproject.toml ./
COPY proto/ proto/
COPY ampd/ ampd/
COPY services/ services/
RUN pip install --no-deps . \
 && rm -rf build ./*.egg-info \
 && python -c "import ampd.cli, services.coordinator.server, services.decode.server, services.prefill.server, services.sidecar.server, grpc_health.v1.health_pb2_grpc" \
 && useradd --create-home --uid 10001 --user-group ampd

USER ampd

# No service by default: docker-compose.yml gives every service its own command.
CMD ["ampd", "--help"]
