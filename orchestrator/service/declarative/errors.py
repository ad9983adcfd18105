"""Errors of declarative environments: a spec's problems, each with the field path it concerns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.core.errors import EnvfleetError, FailedPreconditionError, InvalidRequestError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where (`tasks[2].id`, `limits.memory_mb`) and why."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _describe(prefix: str, problems: Sequence[Problem]) -> str:
    return f"{prefix} ({len(problems)} problem{'s' * (len(problems) != 1)}): " + "; ".join(map(str, problems))


class SpecError(InvalidRequestError):
    """A spec that is malformed: every problem found, each with its field path."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__(_describe("invalid environment spec", problems))
        self.problems = list(problems)


class SpecCheckError(FailedPreconditionError):
    """A well-formed spec that does not work: the image does not build, or the reference does not pass scoring."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__(_describe("environment spec failed validation", problems))
        self.problems = list(problems)


class ScoringError(EnvfleetError):
    """The scoring (or setup) command failed or printed no usable reward: the environment is broken (ENV_ERROR)."""
