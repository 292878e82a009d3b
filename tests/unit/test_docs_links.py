"""The docs cite only what the repo has: every repo path named in docs/*.md, README.md and the
docstrings and comments of ampd/ and services/ exists, nothing cites the design notes that are not
in the repo ("DESIGN.md section N"), and every `ampd <command>` and `make <target>` the docs name
is one the CLI and the Makefile define."""
from __future__ import annotations

import ast
import glob
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
CODE_DIRS = ("ampd", "services")
# Written by `make proto` (ampd.protogen), not committed.
GENERATED = ("ampd/v1",)

# A repo path: a top-level folder of the repo, then path characters. Not part of a longer path
# (`~/.cache/ampd/...`, a URL) nor a dotted module name.
_TOP = r"(?:ampd|services|docs|benchmarks|tests|proto|deploy|\.ci|shared)"
_PATH = re.compile(rf"(?<![\w./~:-]){_TOP}/[\w.*{{}},/-]*[\w*}}/]")
_DESIGN = re.compile(r"DESIGN(?:\.md)?\s*(?:§|sections?\s+\d)")
# In backticks, or at the start of a line of a fenced code block.
_AMPD = re.compile(r"(?:`|^\s*(?:\$ )?)ampd ([a-z][a-z0-9-]*)(?: ([a-z][a-z0-9-]*))?", re.M)
_MAKE = re.compile(r"(?:`|^\s*(?:\$ )?)make ((?:[A-Z_]+=\S+ )*)([a-z][a-z0-9-]*)", re.M)


def _commands_text(text: str) -> str:
    """The text of a page with the prose of its lines dropped outside backticks: fenced code blocks
    whole, and prose lines blanked up to their first backtick (a prose line may start with "make")."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        out.append(line if fenced else line[line.find("`"):] if "`" in line else "")
    return "\n".join(out)


def _expand(path: str) -> list[str]:
    """``services/{a,b}`` -> ``services/a``, ``services/b``."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    path = path.rstrip("/.,")
    if path.startswith(GENERATED):
        return True
    if "*" in path:
        return bool(glob.glob(str(ROOT / path)))
    return (ROOT / path).exists()


def _code_text(path: Path) -> str:
    """The docstrings and comments of one source file."""
    src = path.read_text()
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(src).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def _sources() -> list[tuple[str, str]]:
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in DOCS]
    for d in CODE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            rel = p.relative_to(ROOT)
            if str(rel).startswith(GENERATED):
                continue
            out.append((str(rel), _code_text(p)))
    return out


SOURCES = _sources()


def test_every_cited_path_is_in_the_repo():
    missing = []
    for name, text in SOURCES:
        missing += [f"{name}: {m.group(0)} (a path outside the repo)" for m in re.finditer(r"/work/\S+", text)]
        for m in _PATH.finditer(text):
            for path in _expand(m.group(0)):
                if not _exists(path):
                    missing.append(f"{name}: {path}")
    assert not missing, "paths not in the repo:\n" + "\n".join(sorted(set(missing)))


def test_nothing_cites_the_design_notes():
    cites = [f"{name}: {m.group(0)}" for name, text in SOURCES for m in _DESIGN.finditer(text)]
    assert not cites, "DESIGN.md is not in the repo; cite the docs/ page instead:\n" + "\n".join(cites)


def _commands() -> dict[str, set[str]]:
    """Every `ampd` command, with its subcommands where it has any."""
    import argparse

    from ampd.cli import build_parser

    def choices(parser: argparse.ArgumentParser) -> dict:
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                return a.choices
        return {}

    return {name: set(choices(p)) for name, p in choices(build_parser()).items()}


def test_every_ampd_command_named_in_the_docs_exists():
    commands = _commands()
    assert {"up", "simulate", "bench", "trace", "plan"} <= set(commands)
    bad = []
    for name, text in SOURCES[:len(DOCS)]:
        for m in _AMPD.finditer(_commands_text(text)):
            cmd, sub = m.groups()
            if cmd not in commands:
                bad.append(f"{name}: ampd {cmd}")
            elif commands[cmd] and sub and not sub.startswith("-") and sub not in commands[cmd]:
                bad.append(f"{name}: ampd {cmd} {sub}")
    assert not bad, "commands the CLI does not have:\n" + "\n".join(bad)


def test_every_make_target_named_in_the_docs_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    assert {"demo", "test"} <= targets
    bad = [f"{name}: make {m.group(2)}" for name, text in SOURCES[:len(DOCS)]
           for m in _MAKE.finditer(_commands_text(text)) if m.group(2) not in targets]
    assert not bad, "targets the Makefile does not have:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, paths", [
    ("see `ampd/kv/layout.py` and services/{decode,prefill}", ["ampd/kv/layout.py", "services/decode",
                                                              "services/prefill"]),
    ("~/.cache/ampd/models, http://h/v1/ampd/x, ampd.worker.decode", []),
])
def test_the_path_pattern(text, paths):
    assert [q for m in _PATH.finditer(text) for q in _expand(m.group(0))] == paths


def test_every_module_the_docs_run_exists():
    """`python -m MODULE` and `make bench BENCH=NAME` name modules of the repo."""
    bad = []
    for name, text in SOURCES[:len(DOCS)]:
        for m in re.finditer(r"python3? -m ((?:ampd|services|benchmarks|tests)(?:\.\w+)*)", text):
            path = m.group(1).replace(".", "/")
            if path != path.lower():  # a placeholder: services.SERVICE
                continue
            if not ((ROOT / f"{path}.py").exists() or (ROOT / path / "__main__.py").exists()):
                bad.append(f"{name}: python -m {m.group(1)}")
        for m in re.finditer(r"BENCH=(\w+)", text):
            if not (ROOT / "benchmarks" / f"{m.group(1)}.py").exists():
                bad.append(f"{name}: BENCH={m.group(1)}")
    assert not bad, "modules not in the repo:\n" + "\n".join(bad)
