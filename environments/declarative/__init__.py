"""Declarative environments: an EnvironmentSpec (data) instead of a Python class, registered over gRPC or the CLI."""

from environments.declarative.env import DeclarativeEnvironment, make_environment
from environments.declarative.errors import Problem, ScoringError, SpecCheckError, SpecError
from environments.declarative.spec import EnvironmentSpec, load_spec_file, parse_spec

__all__ = [
    "DeclarativeEnvironment",
    "EnvironmentSpec",
    "Problem",
    "ScoringError",
    "SpecCheckError",
    "SpecError",
    "load_spec_file",
    "make_environment",
    "parse_spec",
]
