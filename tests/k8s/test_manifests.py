"""deploy/k8s rendered by `kubectl kustomize`, read back: every overlay validates against the
Kubernetes schemas client-side (kubernetes-validate, strict: no unknown field), and the objects say
what the deployment needs (every service, its probes on its own ports, the settings, resources,
scrape annotations, GPUs for sglang). No cluster is reached. Part of `make test-k8s`."""
from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kube import OVERLAYS, ROOT, ManifestError, by_kind, expand, pod_for_podman, probe_of, refs, render  # noqa: E402

from ampd import k8s  # noqa: E402
from ampd.config import SERVICE_SETTINGS, SETTINGS, _converter, _kind, add_flags, env_name  # noqa: E402

KUBECTL = os.environ.get("KUBECTL", "kubectl")
if not shutil.which(KUBECTL):
    pytest.skip(f"{KUBECTL} is not installed (make test-k8s installs one)", allow_module_level=True)

SERVICES = {"redis": (), "coordinator": ("coordinator",), "prefill": ("prefill",),
            "decode": ("decode", "sidecar"), "planner": ("planner",), "frontend": ("frontend",)}
ENV_OF_SETTING = {env_name(n): n for n in SETTINGS}


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param, render(ROOT / "deploy/k8s/overlays" / request.param, KUBECTL)


def containers(objs):
    for d in by_kind(objs, "Deployment").values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            yield d, c


def service_of(c: dict) -> str | None:
    """The AMPD service a container runs (`python -m services.X`), None for Redis."""
    cmd = c.get("command", [])
    return cmd[2].split(".")[1] if cmd[:2] == ["python", "-m"] and cmd[2].startswith("services.") else None


def test_validates_client_side(overlay):
    import kubernetes_validate

    _, objs = overlay
    for o in objs:
        kubernetes_validate.validate(o, "1.37.0", strict=True)


def test_validation_catches_a_bad_object(overlay):
    import kubernetes_validate

    _, objs = overlay
    bad = next(o for o in objs if o["kind"] == "Deployment")
    bad = {**bad, "spec": {**bad["spec"], "replica": 2}}  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37.0", strict=True)


def test_every_service_runs_with_its_service(overlay):
    _, objs = overlay
    deps, svcs = by_kind(objs, "Deployment"), by_kind(objs, "Service")
    assert set(deps) == set(SERVICES)
    for name, expected in SERVICES.items():
        cs = deps[name]["spec"]["template"]["spec"]["containers"]
        assert tuple(filter(None, map(service_of, cs))) == expected, name
        # a Service selecting exactly this Deployment's pods, each target port declared by a container
        svc = svcs[name]
        labels = deps[name]["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
        assert deps[name]["spec"]["selector"]["matchLabels"].items() <= labels.items()
        named = {p.get("name") for c in cs for p in c.get("ports", ())}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in named, f"Service {name}: targetPort {p['targetPort']} names no port"


def test_settings_configmap_is_the_generated_one(overlay):
    name, objs = overlay
    cms = {n.rsplit("-", 1)[0]: cm for n, cm in by_kind(objs, "ConfigMap").items()}
    data = cms["ampd-settings"]["data"]
    base = {k: v for k, v in (ln.split("=", 1) for ln in k8s.render().splitlines() if ln and ln[0] != "#")}
    changed = {k: v for k, v in data.items() if base.get(k) != v}
    assert set(data) == set(base), "an overlay may change settings, not add or drop them"
    assert changed == ({} if name == "mock" else {"AMPD_ENGINE": name})
    for key, value in data.items():  # each value reads as its setting does in a service
        setting = ENV_OF_SETTING[key]
        if value != "":
            _converter(setting, _kind(SETTINGS[setting][1]))(value)
    # every AMPD container reads the settings, the process variables and the Secret, in that order
    # (a key in the Secret, AMPD_REDIS_URL with a password, wins)
    cm_names = {n.rsplit("-", 1)[0]: n for n in by_kind(objs, "ConfigMap")}
    for d, c in containers(objs):
        if service_of(c):
            assert c["envFrom"] == [{"configMapRef": {"name": cm_names["ampd-process"]}},
                                    {"configMapRef": {"name": cm_names["ampd-settings"]}},
                                    {"secretRef": {"name": "ampd-secrets"}}], c["name"]


def test_command_lines_parse_as_the_services_flags(overlay):
    """Each container's args are flags its service takes (ampd/config.py), `$(VAR)` refs defined."""
    _, objs = overlay
    for d, c in containers(objs):
        svc = service_of(c)
        if not svc:
            continue
        env = {e["name"]: "x" for e in c.get("env", ())}
        for a in c["args"]:
            assert set(refs(a)) <= set(env), f"{c['name']}: {a} refers to an undefined variable"
        p = argparse.ArgumentParser(exit_on_error=False)
        add_flags(p, SERVICE_SETTINGS[svc])
        args = p.parse_args([expand(a, {k: "10.0.0.1" for k in env}) for a in c["args"]])
        assert args.host == "0.0.0.0", c["name"]  # reachable from the other pods and the kubelet


def test_probes_check_the_service_on_its_own_port(overlay):
    _, objs = overlay
    for d, c in containers(objs):
        svc = service_of(c)
        for kind in ("readinessProbe", "livenessProbe"):
            how, port, path = probe_of(c, kind)
            if svc == "frontend":
                assert (how, path) == ("http", "/healthz")
            elif svc:
                assert how == "grpc", f"{c['name']}: the gRPC health service"
            else:
                assert how == "tcp"
            if svc:
                assert str(port) == c["args"][c["args"].index("--port") + 1], f"{c['name']} {kind}"


def test_scrape_annotations_name_a_metrics_port(overlay):
    _, objs = overlay
    for name, d in by_kind(objs, "Deployment").items():
        ann = d["spec"]["template"]["metadata"].get("annotations", {})
        if name == "redis":
            assert "prometheus.io/scrape" not in ann
            continue
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        c = d["spec"]["template"]["spec"]["containers"][0]
        served = c["args"][c["args"].index("--metrics-port" if "--metrics-port" in c["args"] else "--port") + 1]
        assert ann["prometheus.io/port"] == served, name


def test_resources_and_gpus(overlay):
    name, objs = overlay
    for d, c in containers(objs):
        req = c["resources"]["requests"]
        assert {"cpu", "memory"} <= set(req), f"{c['name']}: requests"
        assert "memory" in c["resources"]["limits"], f"{c['name']}: memory limit"
        gpus = req.get("nvidia.com/gpu")
        engine_side = service_of(c) in ("prefill", "decode")
        if name == "sglang" and engine_side:
            assert gpus == "1" and c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            mounts = {m["mountPath"] for m in c.get("volumeMounts", ())}
            assert "/dev/shm" in mounts
        else:
            assert gpus is None, f"{name}/{c['name']} requests a GPU"
        if service_of(c):
            assert c["image"] == f"ampd:{ {'mock': 'local'}.get(name, name)}"


def test_pods_for_podman():
    """What tests/k8s/play.py plays: a Deployment's pod with its downward API, `$(VAR)`s, Secret,
    ports and probes turned into what podman 4.3 runs."""
    objs = render(ROOT / "deploy/k8s/overlays/mock", KUBECTL)
    dep = by_kind(objs, "Deployment")["decode"]
    pod = pod_for_podman(dep, "decode-7", {"AMPD_INTERNAL_TOKEN": "t"}, {"ampd.test": "k8s"})
    assert pod["kind"] == "Pod" and pod["metadata"]["name"] == "decode-7"
    assert pod["metadata"]["labels"]["ampd.test"] == "k8s"
    dec, side = pod["spec"]["containers"]
    assert "--worker-id" in dec["args"] and dec["args"][dec["args"].index("--worker-id") + 1] == "decode-7"
    assert dec["args"][dec["args"].index("--advertise") + 1] == "decode-7:50061"
    assert {"name": "AMPD_INTERNAL_TOKEN", "value": "t"} in dec["env"]
    assert all("secretRef" not in e for e in dec["envFrom"])
    assert not any(k in c for c in (dec, side) for k in ("ports", "readinessProbe", "livenessProbe"))
    # the rendered object itself is untouched
    assert "$(POD_NAME)" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    with pytest.raises(ManifestError, match="no readinessProbe"):
        probe_of({"name": "c"})
    odd = copy.deepcopy(dep)
    odd["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    with pytest.raises(ManifestError, match="spec.nodeName"):
        pod_for_podman(odd, "x", {}, {})


def test_expand_like_the_kubelet():
    env = {"A": "1"}
    assert expand("$(A):$(B)", env) == "1:$(B)"
    assert expand("$$(A)", env) == "$(A)"


def test_render_errors_are_clear(tmp_path):
    with pytest.raises(ManifestError, match="not found"):
        render(ROOT / "deploy/k8s/overlays/mock", str(tmp_path / "no-kubectl"))
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(ManifestError, match="kustomize"):
        render(tmp_path, KUBECTL)
