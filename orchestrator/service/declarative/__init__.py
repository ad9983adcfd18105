"""Declarative environments: an EnvironmentSpec (data) instead of a Python class, registered over gRPC or the CLI."""

from orchestrator.service.declarative.env import DeclarativeEnvironment, make_environment
from orchestrator.service.declarative.errors import Problem, ScoringError, SpecCheckError, SpecError
from orchestrator.service.declarative.spec import EnvironmentSpec, load_spec_file, parse_spec

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
