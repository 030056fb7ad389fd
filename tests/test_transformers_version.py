"""An unsupported transformers is refused in one line when a model loads, before anything fails deep in a layer."""

from __future__ import annotations

import importlib

import pytest

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.transformers_version import check_transformers


@pytest.mark.parametrize("version", ["5.20.0", "5.24.0", "5.25.0.dev0"])
def test_the_supported_range_loads(version: str) -> None:
    check_transformers(version)  # no error


@pytest.mark.parametrize("version", ["4.57.1", "5.19.2", "6.0.0"])
def test_others_are_refused_with_the_fix(version: str) -> None:
    with pytest.raises(
        VismmoeError, match=rf"transformers {version} is installed.*pip install 'transformers>=5.20,<6'"
    ):
        check_transformers(version)


def test_load_and_doctor_say_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import vismmoe_edge
    from vismmoe_edge.hardware.doctor import check_transformers as doctor_check

    # the module as imported now: `from transformers import <a model class>` replaces transformers' lazy module in
    # sys.modules, so a module object taken at this file's import may no longer be the one the code reads
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", "4.57.1")
    with pytest.raises(VismmoeError, match="transformers 4.57.1 is installed"):
        vismmoe_edge.load()  # the demo model: refused before anything is read
    check = doctor_check()
    assert not check.ok and "4.57.1" in check.detail and "transformers>=5.20,<6" in check.fix
