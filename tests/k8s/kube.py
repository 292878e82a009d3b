"""Reading the rendered manifests, and turning them into what `podman kube play` (4.3, Debian
bookworm's) runs. Pure: no I/O but `render` (which runs `kubectl kustomize`).

`podman kube play` is not a cluster. What a cluster does that it does not, and what `pods_for_podman`
does in its place (docs/deploy.md, "Kubernetes"):

- no controllers: a Deployment becomes `replicas` Pods here, named after the Deployment (one replica)
  or `<name>-<i>`; replacing a pod is the test's job;
- no Services: on a podman network a pod is found by its name, so the single pod of a Deployment
  behind a Service is named after the Service (both are the Deployment's name in deploy/k8s/base);
- no downward API for `status.podIP` and no `$(VAR)` expansion in command and args: POD_NAME and
  POD_IP are given as values (the pod's name stands for its IP: it resolves to it) and `$(VAR)`
  is expanded here as the kubelet would;
- podman 4.3 reads a Secret only in a JSON form of its own: the Secret's values go in as plain `env`;
- podman 4.3 publishes every containerPort on the host's own address (a second Redis on a box
  running one fails to start): the ports are dropped, since the pods reach each other on the podman
  network and the probes take their ports from the rendered manifest;
- no probes: podman turns them into healthchecks run only under systemd, so they are dropped and
  the test runs each probe itself (`probe_of`), from the host, against the pod's address, as a
  kubelet does.
"""
from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("mock", "torch", "sglang")
SECRET = "ampd-secrets"
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class ManifestError(ValueError):
    pass


def render(path: Path, kubectl: str = "kubectl", timeout_s: float = 60) -> list[dict]:
    """`kubectl kustomize path`, parsed: the objects in order."""
    try:
        p = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise ManifestError(f"{kubectl}: not found (make test-k8s installs one from requirements-k8s.txt; "
                            "KUBECTL=... names another)") from None
    if p.returncode:
        raise ManifestError(f"kubectl kustomize {path} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion of command and args: a defined variable is replaced, an
    undefined reference stays as written, `$$(` escapes."""
    out = re.sub(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)
    return out.replace("$$(", "$(")


def refs(text: str) -> list[str]:
    return _REF.findall(text)


def probe_of(container: dict, kind: str = "readinessProbe") -> tuple[str, int, str]:
    """(how, port, path) of a container's probe: how is grpc, http or tcp; a named port resolved."""
    probe = container.get(kind)
    if not probe:
        raise ManifestError(f"container {container['name']}: no {kind}")
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", ())}

    def port(v):
        if isinstance(v, int):
            return v
        if v not in ports:
            raise ManifestError(f"container {container['name']}: {kind} names port {v!r}, which it does not declare")
        return ports[v]

    if "grpc" in probe:
        return "grpc", port(probe["grpc"]["port"]), ""
    if "httpGet" in probe:
        return "http", port(probe["httpGet"]["port"]), probe["httpGet"].get("path", "/")
    if "tcpSocket" in probe:
        return "tcp", port(probe["tcpSocket"]["port"]), ""
    raise ManifestError(f"container {container['name']}: {kind} is none of grpc, httpGet, tcpSocket")


def pod_names(deployment: dict) -> list[str]:
    name, n = deployment["metadata"]["name"], deployment["spec"].get("replicas", 1)
    return [name] if n == 1 else [f"{name}-{i}" for i in range(n)]


def pod_for_podman(deployment: dict, pod_name: str, secret: dict[str, str], labels: dict[str, str]) -> dict:
    """One Pod of `deployment`'s template, as `podman kube play` can run it (module docstring)."""
    tmpl = copy.deepcopy(deployment["spec"]["template"])
    meta = tmpl.get("metadata", {})
    spec = tmpl["spec"]
    for c in spec["containers"]:
        env: dict[str, str] = {}
        plain = []
        for e in c.get("env", ()):
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
                plain.append({"name": e["name"], "value": env[e["name"]]})
                continue
            field = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            if field not in ("metadata.name", "status.podIP"):
                raise ManifestError(f"{pod_name}/{c['name']}: env {e['name']}: only fieldRef metadata.name and "
                                    f"status.podIP are converted, not {e.get('valueFrom')}")
            env[e["name"]] = pod_name  # the pod's name resolves to its address on the podman network
            plain.append({"name": e["name"], "value": pod_name})
        froms = []
        for src in c.get("envFrom", ()):
            if "secretRef" in src:
                if src["secretRef"]["name"] != SECRET:
                    raise ManifestError(f"{pod_name}/{c['name']}: unknown Secret {src['secretRef']['name']!r}")
                plain += [{"name": k, "value": v} for k, v in secret.items()]
            else:
                froms.append(src)
        c["env"], c["envFrom"] = plain, froms
        for key in ("command", "args"):
            if key in c:
                c[key] = [expand(str(a), env) for a in c[key]]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            c.pop(probe, None)
        c.pop("ports", None)  # podman 4.3 would publish each on the host (module docstring)
    spec["restartPolicy"] = "Always"
    spec["hostname"] = pod_name
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name, "labels": {**meta.get("labels", {}), **labels},
                         "annotations": meta.get("annotations", {})},
            "spec": spec}


def play_file(objs: list[dict], pods: list[dict]) -> str:
    """The ConfigMaps (kube play resolves configMapRef within its input) and `pods`, as one YAML."""
    return yaml.safe_dump_all([*by_kind(objs, "ConfigMap").values(), *pods], sort_keys=False)
