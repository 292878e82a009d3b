"""docker-compose.yml, Dockerfile and .dockerignore, checked without Docker.

Settings reach a compose service through AMPD_* environment variables that ampd/config.py derives
from the settings the service reads (ampd.config.SERVICE_SETTINGS); the command line carries only
where the process runs. These tests check that derivation: the variables compose passes are exactly
the ones the service reads, each one reaches the parsed settings, an empty one means the config
default, and every command is parsed by the service's own parser (its `build_parser()`).
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml

from ampd import config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ampd-dashboard.json"

OBSERVABILITY = {"prometheus", "grafana"}
HTTP_SERVICES = ["frontend"]  # the OpenAI-compatible front: HTTP, its /metrics on its --port
EXPECTED = {"redis", "coordinator", "decode-0", "decode-1", "sidecar-0", "sidecar-1", "prefill-0", "prefill-1",
            "planner", *HTTP_SERVICES, *OBSERVABILITY}
GRPC_SERVICES = sorted(EXPECTED - {"redis"} - OBSERVABILITY - set(HTTP_SERVICES))
AMPD_SERVICES = GRPC_SERVICES + HTTP_SERVICES
# published on the host's loopback: the coordinator and the front (clients), the planner, Prometheus and Grafana
PUBLISHED = {"coordinator": 50051, "frontend": 8000, "planner": 50060, "prometheus": 9090, "grafana": 3000}
REDIS_URL = "redis://redis:6379/0"

_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
# Variables `docker compose up` refuses to run without (${VAR:?...}), with a sample value.
REQUIRED = {"AMPD_INTERNAL_TOKEN": "compose-test-internal-secret"}


# ------------------------------------------------------------------------------------------ helpers
def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose-style interpolation: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}
    (a required variable: REQUIRED's sample value when ``env`` lacks it)."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        expr = m.group("braced") if m.group("braced") is not None else m.group("plain")
        if ":?" in expr:
            name = expr.split(":?", 1)[0]
            assert name in REQUIRED, f"${{{name}}} is required but not in REQUIRED"
            return env.get(name) or REQUIRED[name]
        for sep, empty_counts in ((":-", True), ("-", False)):
            if sep in expr:
                name, default = expr.split(sep, 1)
                val = env.get(name)
                if val is None or (empty_counts and val == ""):
                    return default
                return val
        if expr not in env:
            raise AssertionError(f"${{{expr}}} has no default: `docker compose up` would need it set")
        return env[expr]

    return _VAR.sub(sub, value)


def variables(text: str) -> set[str]:
    names = set()
    for m in _VAR.finditer(text):
        expr = m.group("braced") or m.group("plain")
        if expr:
            names.add(re.split(r":?-|:\?", expr, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def command(svc: dict, env: dict[str, str] | None = None) -> list[str]:
    cmd = svc["command"]
    assert isinstance(cmd, list), "commands are exec-form lists (no shell, signals reach Python)"
    return [interpolate(str(a), env or {}) for a in cmd]


def module_of(cmd: list[str]) -> str:
    assert cmd[:2] == ["python", "-m"], cmd
    return cmd[2]


def flags(argv: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            assert a not in out, f"{a} given twice"
            out[a] = argv[i + 1]
    return out


def _main_module(package: str) -> str:
    """The module whose `main` `python -m <package>` calls (read from <package>/__main__.py)."""
    path = ROOT / package.replace(".", "/") / "__main__.py"
    assert path.is_file(), f"`python -m {package}` needs {path.relative_to(ROOT)}"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and any(a.name == "main" for a in node.names):
            return node.module
    raise AssertionError(f"{path} does not import a main()")


def real_parser(package: str, environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser `python -m <package>` uses, built under ``environ`` (its only AMPD_* variables)."""
    mod = importlib.import_module(_main_module(package))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AMPD_")}
    with mock.patch.dict(os.environ, {**clean, **(environ or {})}, clear=True):
        return mod.build_parser()


def service_env(svc: dict, host_env: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment: compose's `environment`, interpolated from the host's."""
    return {k: interpolate(str(v), host_env or {}) for k, v in svc["environment"].items()}


def parse(svc: dict, host_env: dict[str, str] | None = None) -> argparse.Namespace:
    cmd = command(svc, host_env)
    parser = real_parser(module_of(cmd), service_env(svc, host_env))
    with mock.patch.object(parser, "exit", side_effect=AssertionError):
        return parser.parse_args(cmd[3:])


def kind_of(name: str) -> str:
    return name.split("-")[0]


def uses_redis(name: str) -> bool:
    """The sidecars and the planner keep no shared state."""
    return "redis_url" in config.SERVICE_SETTINGS[kind_of(name)]


# Variables a process reads that are not settings: logging (ampd/logs.py).
NOT_SETTINGS = {"AMPD_LOG_LEVEL", "AMPD_LOG_FORMAT"}


# --------------------------------------------------------------------------------------- services
def test_every_service_is_there(services):
    assert set(services) == EXPECTED


def test_all_but_redis_build_from_the_one_dockerfile(services):
    redis = services["redis"]
    image = interpolate(redis["image"], {})
    assert image.split(":")[0] == "redis" and image.split(":")[1].startswith("7"), "the official redis:7"
    assert interpolate(redis["image"], {"AMPD_REDIS_IMAGE": "localhost/ampd-redis:7"}) == "localhost/ampd-redis:7"
    assert "build" not in redis
    assert command(redis) == ["redis-server", "--save", "", "--appendonly", "no"]
    images = set()
    for name in AMPD_SERVICES:
        build = services[name]["build"]
        assert build["context"] == "." and build.get("dockerfile", "Dockerfile") == "Dockerfile", name
        images.add(services[name].get("image"))
    assert len(images) == 1, "one image for every AMPD service"


@pytest.mark.parametrize("name", AMPD_SERVICES)
def test_command_module_exists_and_flags_parse(services, name):
    cmd = command(services[name])
    package = module_of(cmd)
    assert (ROOT / package.replace(".", "/") / "__main__.py").is_file()
    assert package == f"services.{name.split('-')[0]}"
    args = parse(services[name])
    assert args.host == "0.0.0.0", "bind every interface inside the container"
    assert args.port > 0, "fixed ports inside containers"


@pytest.mark.parametrize("name", AMPD_SERVICES)
def test_compose_passes_exactly_the_settings_the_service_reads(services, name):
    """The derivation: compose's AMPD_* keys == ampd.config.env_names(kind), and the command line
    carries only per-process settings."""
    env = {k for k in services[name]["environment"] if k.startswith("AMPD_")} - NOT_SETTINGS
    assert env == set(config.env_names(kind_of(name))), name
    placement = {config.flag_name(n) for n in config.PLACEMENT}
    given = set(flags(command(services[name])[3:]))
    assert given <= placement, f"{name}: settings on the command line: {sorted(given - placement)}"


@pytest.mark.parametrize("name", AMPD_SERVICES)
def test_unset_variables_give_the_config_defaults(services, name):
    args = parse(services[name])
    defaults = config.Config().flat()
    for setting in config.SERVICE_SETTINGS[kind_of(name)]:
        if setting in config.PLACEMENT or setting in ("redis_url", "internal_token"):
            continue
        got = getattr(args, setting)
        if setting == "coordinator_address":  # the front dials the coordinator's service by name
            assert got == "coordinator:50051"
            continue
        assert (tuple(got) if isinstance(got, list) else got) == defaults[setting], f"{name} {setting}"
    if uses_redis(name):
        assert args.redis_url == REDIS_URL


@pytest.mark.parametrize("name", AMPD_SERVICES)
def test_every_variable_reaches_the_parsed_settings(services, name):
    host = {"AMPD_POLICY": "remote", "AMPD_PROFILE": "llama3.1-70b@h20", "AMPD_TTFT_SLO": "5",
            "AMPD_ITL_SLO": "0.05", "AMPD_PREFILL_TP": "2", "AMPD_DECODE_TP": "4", "AMPD_NAMESPACE": "x",
            "AMPD_REORDER_WINDOW": "5", "AMPD_KV_OVERLAP": "false", "AMPD_KV_ADMISSION": "fail",
            "AMPD_STATS_WINDOW": "4.5", "AMPD_SLACK": "window", "AMPD_SEED": "7", "AMPD_STATS_MODE": "read",
            "AMPD_CHUNKED_PREFILL": "true", "AMPD_TOOL": "echo=ampd.tools:replay", "AMPD_KV_POOL_MB": "64",
            "AMPD_REDIS_URL": "redis://elsewhere:6380/1", "AMPD_PROFILES_DIR": "/profiles"}
    args = parse(services[name], host)
    want = {"policy": "remote", "profile": "llama3.1-70b@h20", "ttft_slo": 5.0, "itl_slo": 0.05, "namespace": "x",
            "reorder_window": 5, "kv_overlap": False, "kv_admission": "fail", "stats_window": 4.5,
            "slack": "window", "seed": 7, "stats_mode": "read", "chunked_prefill": True,
            "tool": ["echo=ampd.tools:replay"], "kv_pool_mb": 64, "redis_url": "redis://elsewhere:6380/1",
            "profiles_dir": "/profiles",
            "tp": {"decode": 4, "prefill": 2}.get(kind_of(name))}
    checked = 0
    for setting in config.SERVICE_SETTINGS[kind_of(name)]:
        if setting in want:
            assert getattr(args, setting) == want[setting], f"{name} {setting}"
            checked += 1
    assert checked >= 1


def test_a_bad_variable_names_itself(services):
    env = service_env(services["prefill-0"], {"AMPD_REORDER_WINDOW": "0"})
    with pytest.raises(config.ConfigError, match=r"AMPD_REORDER_WINDOW \(--reorder-window\): must be >= 1"):
        real_parser("services.prefill", env)


def test_ampd_up_starts_the_same_settings_as_compose(services):
    """Both derive from ampd/config.py: with nothing set, every setting `ampd up` passes a child
    equals what the compose service parses (placement and the Redis URL aside)."""
    from ampd import launcher

    spawned: dict[str, list[str]] = {}

    def spawn(self, name, argv, keep_port=False):
        spawned[name] = list(argv(0))
        return mock.Mock(name=name)

    def wait_ready(self, children, timeout_s=90.0):
        return {c._mock_name: 1000 + i for i, c in enumerate(children)}

    opts = launcher.Options(prefill="tp1*2", decode="tp1*2", redis_url="redis://127.0.0.1:1/0")
    with mock.patch.object(launcher.Deployment, "_spawn", spawn), \
            mock.patch.object(launcher.Deployment, "_wait_ready", wait_ready):
        dep = launcher.Deployment(opts, supervise=False)
        dep.start()
        dep.children.clear()
    for name in GRPC_SERVICES:
        if name == "planner":  # `ampd up` runs no planner process (`ampd up --plan` plans before it starts)
            continue
        package = module_of(command(services[name]))
        assert spawned[name][1:3] == ["-m", package], name
        ours = parse(services[name])
        theirs = real_parser(package, {}).parse_args(spawned[name][3:])
        for setting in config.SERVICE_SETTINGS[kind_of(name)]:
            # secrets reach a child in its environment (`ampd up` makes the internal one)
            if setting not in config.PLACEMENT and setting not in config.SECRET_SETTINGS:
                if setting == "worker_threads":  # `ampd up` splits its machine's cores; a container has its own
                    assert theirs.worker_threads >= 1 and ours.worker_threads == 0, name
                    continue
                assert getattr(ours, setting) == getattr(theirs, setting), f"{name} {setting}"


def test_the_internal_secret_is_required_and_reaches_every_internal_service(services):
    """Issue 24 item 7: compose does not start without AMPD_INTERNAL_TOKEN (`make compose-secret`
    writes one to .env), and every coordinator, worker and sidecar gets the same one."""
    sys.path.insert(0, str(ROOT / "tests" / "compose"))
    from resolve import ResolveError, resolve

    with pytest.raises(ResolveError, match=r"AMPD_INTERNAL_TOKEN: run make compose-secret"):
        resolve(COMPOSE, {"AMPD_INTERNAL_TOKEN": ""})
    for name in AMPD_SERVICES:
        wants = "internal_token" in config.SERVICE_SETTINGS[kind_of(name)]
        assert ("AMPD_INTERNAL_TOKEN" in services[name]["environment"]) == wants, name
        if wants:
            assert parse(services[name], {"AMPD_INTERNAL_TOKEN": "s3"}).internal_token == "s3", name
    assert "compose-secret:" in (ROOT / "Makefile").read_text()
    assert ".env" in DOCKERIGNORE.read_text().split() and ".env" in (ROOT / ".gitignore").read_text().split()


def test_decode_workers_point_at_their_own_sidecar(services):
    sidecar_ports = {n: parse(services[n]).port for n in services if n.startswith("sidecar")}
    decodes = [n for n in services if n.startswith("decode")]
    assert len(decodes) == len(sidecar_ports) == 2
    used = set()
    for name in decodes:
        host, port = parse(services[name]).sidecar.rsplit(":", 1)
        assert host in sidecar_ports, f"{name}: --sidecar {host} is not a service"
        assert int(port) == sidecar_ports[host], f"{name}: {host} listens on {sidecar_ports[host]}"
        assert host == name.replace("decode", "sidecar")
        assert host in services[name]["depends_on"]
        used.add(host)
    assert used == set(sidecar_ports), "one sidecar per decode worker"


def test_workers_advertise_their_own_name_and_port(services):
    for name in GRPC_SERVICES:
        args = parse(services[name])
        if name.startswith(("decode", "prefill")):
            assert args.advertise == f"{name}:{args.port}"
            assert args.worker_id == name
            assert args.redis_url == REDIS_URL
        elif name.startswith("sidecar"):
            assert args.name == name
        elif uses_redis(name):
            assert args.redis_url == REDIS_URL


def test_ports_unique_and_only_the_coordinator_and_observability_published(services):
    ports = [parse(services[n]).port for n in AMPD_SERVICES] + [parse(services[n]).metrics_port for n in GRPC_SERVICES]
    assert len(set(ports)) == len(ports), ports
    assert parse(services["coordinator"]).port == 50051
    for name, svc in services.items():
        if name not in PUBLISHED:
            assert "ports" not in svc, f"{name} is reachable only on the compose network"
    for name, port in PUBLISHED.items():
        (published,) = services[name]["ports"]
        host_ip, host_port, container_port = interpolate(published, {}).split(":")
        assert (host_ip, host_port, container_port) == ("127.0.0.1", str(port), str(port)), name


# ---------------------------------------------------------------------------------- observability
@pytest.mark.parametrize("name", GRPC_SERVICES)
def test_every_service_serves_metrics_on_a_fixed_port(services, name):
    assert parse(services[name]).metrics_port > 0


def test_prometheus_scrapes_every_ampd_service(services):
    """deploy/prometheus.yml: one job per kind, a target <service>:<its --metrics-port> for every
    AMPD service, nothing else."""
    doc = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    scraped = {}
    for job in doc["scrape_configs"]:
        for sc in job["static_configs"]:
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                assert host not in scraped, f"{host} scraped twice"
                scraped[host] = (job["job_name"], int(port))
    want = {n: (kind_of(n), parse(services[n]).metrics_port) for n in GRPC_SERVICES}
    want.update({n: (kind_of(n), parse(services[n]).port) for n in HTTP_SERVICES})
    assert scraped == want
    prom = services["prometheus"]
    assert prom["image"].startswith("prom/prometheus:v") and "latest" not in prom["image"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in prom["volumes"]}
    assert mounts["./deploy/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]


def test_grafana_provisions_prometheus_and_the_dashboard(services):
    import json

    graf = services["grafana"]
    assert graf["image"].startswith("grafana/grafana:") and "latest" not in graf["image"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in graf["volumes"]}
    for src in mounts:
        assert (ROOT / src).exists(), src
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    dash_path = mounts["./deploy/grafana/ampd-dashboard.json"]
    providers = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/ampd.yml").read_text())["providers"]
    assert any(dash_path.startswith(p["options"]["path"] + "/") for p in providers)
    (source,) = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dash = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p.get("targets", ())}
    assert uids == {source["uid"]}, "every panel reads the provisioned data source"
    assert graf["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_depends_on_and_healthchecks(services):
    for name, svc in services.items():
        for target, cond in (svc.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on missing {target}"
            assert target != name
            assert cond["condition"] in {"service_healthy", "service_started"}
            if target == "redis" or target.startswith("sidecar"):
                assert cond["condition"] == "service_healthy"
        assert "healthcheck" in svc, f"{name} has no healthcheck"
    for name in OBSERVABILITY:
        test = services[name]["healthcheck"]["test"]
        port = services[name]["ports"][0].rsplit(":", 1)[1]
        assert test[0] == "CMD-SHELL" and test[1].startswith("wget ") and f"http://127.0.0.1:{port}/" in test[1], name
    for name in AMPD_SERVICES:
        if uses_redis(name):
            assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in HTTP_SERVICES:
        assert services[name]["depends_on"]["coordinator"]["condition"] == "service_healthy"
        port = parse(services[name]).port
        assert services[name]["healthcheck"]["test"] == [
            "CMD-SHELL", f"python -m ampd.front.healthcheck http://127.0.0.1:{port}/health"]
    # The coordinator reads the worker registry at start (as `ampd up` starts it last).
    assert {n for n in GRPC_SERVICES if n != "coordinator" and uses_redis(n)} \
        <= set(services["coordinator"]["depends_on"])
    assert services["redis"]["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli ping"]


def test_healthchecks_are_one_shell_string(services):
    """podman-compose 1.0.3 joins a CMD list of several words into one garbled shell word; a
    CMD-SHELL string with plain words passes through every compose engine alike."""
    for name, svc in services.items():
        test = svc["healthcheck"]["test"]
        assert len(test) == 2 and test[0] == "CMD-SHELL", name
        assert shlex.split(test[1]) == test[1].split(), f"{name}: quoting in {test[1]!r}"


@pytest.mark.parametrize("name", GRPC_SERVICES)
def test_grpc_healthcheck_targets_own_port(services, name):
    test = services[name]["healthcheck"]["test"]
    assert test == ["CMD-SHELL", f"python -m ampd.healthcheck 127.0.0.1:{parse(services[name]).port}"]


def test_shared_environment(services):
    for name in AMPD_SERVICES:
        env = {k: interpolate(str(v), {}) for k, v in services[name]["environment"].items()}
        assert env["UCX_TLS"] == "tcp,self", "UCX must not rely on CMA/shm across containers"
        assert env["NIXL_LOG_LEVEL"] == "WARN"
        assert env["PYTHONUNBUFFERED"] == "1"


def test_every_variable_has_a_default_and_is_documented():
    text = COMPOSE.read_text()
    doc = DEPLOY_DOC.read_text()
    raw = yaml.safe_load(text)
    # Interpolating every string with an empty environment raises on a variable with no default.
    def walk(node):
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, str):
            interpolate(node, {})
    walk(raw)
    for var in variables(text):
        assert var in doc, f"{var} is not documented in docs/deploy.md"


# ----------------------------------------------------------------------------------------- image
def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_copies_what_the_image_needs():
    ins = _dockerfile_instructions()
    # The base is a build argument (no registry here: tests/compose/setup.sh builds a local one),
    # by default the official slim Python.
    assert ins[0][0] == "ARG" and ins[0][1] == "BASE_IMAGE=python:3.11-slim"
    assert ins[1] == ("FROM", "${BASE_IMAGE}")
    copied = set()
    for op, rest in ins:
        if op == "COPY":
            *srcs, _dst = shlex.split(rest)
            copied |= {s.rstrip("/") for s in srcs if not s.startswith("--")}
    needed = {"requirements.txt", "requirements-nixl.txt", "pyproject.toml", "proto", "ampd", "services"}
    assert needed <= copied, f"missing: {sorted(needed - copied)}"
    for path in copied:
        assert (ROOT / path).exists(), path
    # Every package pyproject.toml ships is copied.
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in include:
        assert any(fnmatch.fnmatch(p, pattern) for p in copied), pattern


def test_dockerfile_installs_like_the_makefile():
    runs = " && ".join(rest for op, rest in _dockerfile_instructions() if op == "RUN")
    steps = [re.sub(r"\s+", " ", s.strip()) for s in re.split(r"&&|;", runs)]
    pip = [s for s in steps if re.match(r"(python -m )?pip install", s)]
    req = [i for i, s in enumerate(pip) if re.search(r"-r requirements\.txt\b", s)]
    nixl = [i for i, s in enumerate(pip) if "-r requirements-nixl.txt" in s]
    own = [i for i, s in enumerate(pip) if re.search(r"install (--no-deps )?\.$", s) or s.endswith(" .")]
    assert req and nixl and own, pip
    assert "--no-deps" not in pip[req[0]]
    assert "--no-deps" in pip[nixl[0]], "nixl lists torch: install it with --no-deps"
    assert "--no-deps" in pip[own[0]]
    assert req[0] < nixl[0] < own[0]


def test_dockerfile_env_user_and_default_command():
    ins = _dockerfile_instructions()
    env = " ".join(rest for op, rest in ins if op == "ENV")
    assert "NIXL_LOG_LEVEL=WARN" in env and "PYTHONUNBUFFERED=1" in env
    users = [rest for op, rest in ins if op == "USER"]
    assert users and users[-1] not in {"root", "0"}
    assert [op for op, _ in ins if op in {"CMD", "ENTRYPOINT"}] == ["CMD"], "compose commands replace CMD"


def test_dockerignore_keeps_what_the_dockerfile_copies():
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    assert ".venv" in patterns and ".git" in patterns
    needed = ["requirements.txt", "requirements-nixl.txt", "pyproject.toml", "proto/ampd/v1",
              "ampd/cli.py", "ampd/v1/__init__.py", "ampd/perf/profiles", "services/decode/server.py"]
    for path in needed:
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        for pat in patterns:
            if pat.startswith("!"):
                continue
            p = pat.rstrip("/")
            for pre in prefixes:
                assert not fnmatch.fnmatch(pre, p), f".dockerignore {pat!r} excludes {path}"


# ------------------------------------------------------------------ `python -m services.X --help`
@pytest.mark.parametrize("package", ["services.coordinator", "services.decode", "services.prefill",
                                     "services.sidecar"])
def test_python_dash_m_help_lists_every_compose_flag(services, package):
    """The container runs `python -m services.X`: it starts and knows every flag compose passes."""
    used = set()
    for name in GRPC_SERVICES:
        cmd = command(services[name])
        if module_of(cmd) == package:
            used |= set(flags(cmd[3:]))
    assert used
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN")
    out = subprocess.run([sys.executable, "-m", package, "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in used:
        assert flag in out.stdout, f"{package} --help does not list {flag}"
