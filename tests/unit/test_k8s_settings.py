"""deploy/k8s/base/settings.env, the ConfigMap of settings, is what `python -m ampd.k8s` writes from
ampd/config.py now: a setting added or a default changed without regenerating it fails here."""
from __future__ import annotations

from ampd import k8s
from ampd.config import PLACEMENT, SECRET_SETTINGS, SERVICE_SETTINGS, SETTINGS, _converter, _default, _kind, env_name


def _parse(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            assert key not in out, f"{key} twice"
            out[key] = value
    return out


def test_settings_env_is_fresh():
    assert k8s.OUT.read_text() == k8s.render(), "deploy/k8s/base/settings.env is stale: run python -m ampd.k8s"


def test_every_service_setting_is_there_once_with_its_default():
    env = _parse(k8s.render())
    for service in k8s.SERVICES:
        for name in SERVICE_SETTINGS[service]:
            key = env_name(name)
            if name in PLACEMENT or (name in SECRET_SETTINGS and name not in k8s.WIRING):
                assert key not in env, f"{key}: per-process or secret, not in the ConfigMap"
                continue
            assert key in env, f"{key} ({service}) missing"
            if name in k8s.WIRING:
                continue
            # read back as a service reads its environment: the default, unchanged
            _cls, f = SETTINGS[name]
            if env[key] != "":
                assert _converter(name, _kind(f))(env[key]) == _default(f), key
            else:
                assert _default(f) in ("", ()), key


def test_check_mode_and_bad_path(tmp_path, capsys):
    out = tmp_path / "settings.env"
    assert k8s.main(["--out", str(out), "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert k8s.main(["--out", str(out)]) == 0
    assert k8s.main(["--out", str(out), "--check"]) == 0
    assert k8s.main(["--out", str(tmp_path / "no" / "such" / "dir.env")]) == 2
    assert "cannot write" in capsys.readouterr().err
