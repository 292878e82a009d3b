"""docker-compose.yml resolved for podman-compose 1.0.3 (Debian bookworm's), which misreads it.

podman-compose 1.0.3 leaves `${NAME:-}` (an empty default, used for every AMPD_* setting: empty
means the ampd/config.py default) in place, literally, so a service gets the text `${AMPD_TOOL:-}`
as its setting. This module does Compose's interpolation itself -- `$$`, `$NAME`, `${NAME}`,
`${NAME:-default}`, `${NAME-default}`, `${NAME:?error}`; the shell's environment first, then a `.env` file beside the
compose file -- and writes a copy with no variables left, with relative paths made absolute, that
podman-compose then runs as is. Docker Compose and newer podman-compose read docker-compose.yml
directly.

    .venv/bin/python tests/compose/resolve.py -o /tmp/ampd-compose.yml
    podman-compose -p ampd -f /tmp/ampd-compose.yml up -d
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


class ResolveError(ValueError):
    pass


def interpolate(value: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group("escaped"):
            return "$$"  # stays escaped: podman-compose interpolates the copy once more
        expr = m.group("braced") if m.group("braced") is not None else m.group("plain")
        if ":?" in expr:  # required: set and not empty, or Compose's error
            name, message = expr.split(":?", 1)
            if not env.get(name):
                raise ResolveError(f"{name}: {message}")
            return env[name]
        for sep, empty_counts in ((":-", True), ("-", False)):
            if sep in expr:
                name, default = expr.split(sep, 1)
                val = env.get(name)
                return default if val is None or (empty_counts and val == "") else val
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", expr):
            raise ResolveError(f"${{{expr}}}: unsupported substitution")
        return env.get(expr, "")

    return _VAR.sub(sub, value)


def dotenv(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (comments, blank lines and `export ` ignored; one level of quotes removed)."""
    out: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line or line.startswith("#") or "=" not in line:
                continue
            key, _, val = line.removeprefix("export ").partition("=")
            val = val.strip()
            if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
                val = val[1:-1]
            out[key.strip()] = val
    return out


def _walk(node, env):
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_walk(v, env) for v in node]
    if isinstance(node, str):
        return interpolate(node, env)
    return node


def resolve(path: Path = COMPOSE, environ: dict[str, str] | None = None) -> dict:
    """The compose file at ``path``, interpolated, YAML merge keys applied, paths absolute."""
    env = {**dotenv(path.parent / ".env"), **(os.environ if environ is None else environ)}
    doc = _walk(yaml.safe_load(path.read_text()), env)
    base = path.parent.resolve()
    for svc in (doc.get("services") or {}).values():
        build = svc.get("build")
        if isinstance(build, str):
            svc["build"] = build = {"context": build}
        if isinstance(build, dict) and not os.path.isabs(build.get("context", ".")):
            build["context"] = str(base / build.get("context", "."))
        vols = []
        for v in svc.get("volumes") or ():
            if isinstance(v, str) and v.startswith("."):
                src, sep, rest = v.partition(":")
                v = str((base / src).resolve()) + sep + rest
            vols.append(v)
        if vols:
            svc["volumes"] = vols
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-f", "--file", type=Path, default=COMPOSE, help="compose file (default docker-compose.yml)")
    p.add_argument("-o", "--out", type=Path, help="write here (default: stdout)")
    args = p.parse_args(argv)
    try:
        text = yaml.safe_dump(resolve(args.file), sort_keys=False)
    except (OSError, yaml.YAMLError, ResolveError) as exc:
        print(f"resolve: {exc}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
