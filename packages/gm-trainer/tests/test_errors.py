"""One error hierarchy: every error class the project defines is a GraphModeError, in the
configuration branch (also a ValueError) or the runtime branch (also a RuntimeError)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from gm_config import ConfigError, GraphModeError, GraphModeRuntimeError

PACKAGES = ("gm_config", "gm_passes", "gm_trace", "gm_trainer")


def _error_classes() -> dict[str, type]:
    found = {}
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                defined_here = inspect.isclass(value) and value.__module__ == info.name
                is_error = defined_here and issubclass(value, Exception)
                if is_error and not issubclass(value, Warning) and value is not GraphModeError:
                    found[f"{info.name}.{name}"] = value
    return found


ERRORS = _error_classes()


def test_the_project_defines_errors_in_every_layer():
    assert {name.split(".")[0] for name in ERRORS} == set(PACKAGES)


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_every_error_is_a_graph_mode_error_in_one_branch(name):
    error = ERRORS[name]
    assert issubclass(error, GraphModeError), f"{name} is not a GraphModeError"
    branches = [issubclass(error, ConfigError), issubclass(error, GraphModeRuntimeError)]
    assert branches.count(True) == 1, f"{name} must be in exactly one branch"
    if branches[0]:
        assert issubclass(error, ValueError)
    else:
        assert issubclass(error, RuntimeError)
