"""Environments given by reference (module:ClassName), as workers and benchmarks load them."""

from __future__ import annotations

import pytest

from orchestrator.core.errors import InvalidEnvironmentError
from orchestrator.service.registry import Registry


def test_a_reference_loads_an_environment_class() -> None:
    registry = Registry()
    env = registry.load("environments.python_tool:PythonToolEnv")
    assert registry.get("python-tool") is env
    assert registry.lookup("python-tool").source == "reference:environments.python_tool:PythonToolEnv"


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("environments.python_tool", "must be module:ClassName"),
        ("no.such.module:Env", "No module named 'no'"),
        ("environments.python_tool:Nope", "has no attribute 'Nope'"),
        ("orchestrator.core.models:Turn", "is not an Environment class"),
    ],
)
def test_a_bad_reference_says_what_is_wrong(reference: str, message: str) -> None:
    with pytest.raises(InvalidEnvironmentError, match=message):
        Registry().load(reference)
