"""Every docstring example in the package runs and prints what it says (STYLE: examples run)."""

import doctest
import importlib
import pathlib

import pytest

import jaxopt_train

_ROOT = pathlib.Path(jaxopt_train.__file__).parent
_MODULES = sorted(
    "jaxopt_train." + ".".join(path.relative_to(_ROOT).with_suffix("").parts)
    for path in _ROOT.rglob("*.py") if ">>>" in path.read_text(encoding="utf-8"))


def test_the_examples_are_found():
    assert "jaxopt_train.runtime.memory" in _MODULES and len(_MODULES) >= 5


@pytest.mark.parametrize("name", _MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result}"
