"""Shared by the import-time stand-ins next to this file (see README there): a name that resolves
at import and fails loudly if anything ever calls it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class Absent:
    """Any attribute or item of it is another Absent; calling it raises, naming what was called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "Absent":
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self._name}.{attr}")

    def __getitem__(self, key: object) -> "Absent":
        return Absent(f"{self._name}[{key!r}]")

    def __call__(self, *args: object, **kwargs: object) -> "Absent":
        raise RuntimeError(f"{self._name} was called, but it is an import-time stand-in (tests/sglang/standins): "
                           "this SGLang path needs the real package")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _Module(types.ModuleType):
    def __getattr__(self, attr: str) -> Absent:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every submodule of `root` importable as a module whose names are Absent."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201 (importlib's signature)
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001, ANN201
        mod = _Module(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module) -> None:  # noqa: ANN001
        pass


def install(package: types.ModuleType) -> None:
    """`package`'s missing names and submodules become Absent."""
    package.__class__ = _Module
    sys.meta_path.append(_Finder(package.__name__))
