"""The hot dataclasses' written-out ``__init__`` takes exactly the fields, in their order, with
their defaults; a factory default is None. On the sources only: compiled, an ``__init__`` shows no
signature (tests/unit/test_compiled.py reruns on the build only the files that import a core; this
one takes the classes from tests/unit/test_inits.py)."""
import dataclasses
import inspect

import pytest

from tests.unit.test_inits import WRITTEN_OUT


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda c: c.__name__)
def test_init_takes_the_fields(cls):
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    for f, p in zip(fields, params):
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default and type(p.default) is type(f.default), f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert p.default is None, f.name
        else:
            assert p.default is inspect.Parameter.empty, f.name
