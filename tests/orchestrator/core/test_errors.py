"""One exception tree: every envfleet error derives from the shared bases, and the gRPC edge maps it by base class."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import grpc
import pytest

import environments
import orchestrator
from orchestrator.core.errors import ContextFull, EnvfleetError, EnvironmentBroken, PolicyError
from orchestrator.server.errors import status_for

# control flow inside one module, never raised past it; and the stdlib-only snapshot script, which also runs inside
# images where envfleet is not installed (the dataset builder wraps its errors)
PRIVATE = {
    *("_Retryable", "_CutAtCap", "_HTTPError", "_Hang", "SnapshotError", "ArchiveLimitError", "_Refused", "_Unusable"),
}
# errors that classify a rollout (POLICY_ERROR, ENV_ERROR) instead of answering a call
CLASSIFYING = (PolicyError, EnvironmentBroken, ContextFull)


def _all_exception_classes() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for package in (orchestrator, environments):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                    found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return list(found.values())


ERRORS = _all_exception_classes()


def test_the_walk_finds_the_errors_of_every_layer() -> None:
    modules = {cls.__module__ for cls in ERRORS}
    expected = {"orchestrator.core.errors", "orchestrator.service.declarative.errors", "environments.swe.evaluate"}
    assert expected <= modules


@pytest.mark.parametrize("cls", [c for c in ERRORS if c.__name__ not in PRIVATE], ids=lambda c: c.__qualname__)
def test_every_error_derives_from_the_root(cls: type[BaseException]) -> None:
    assert issubclass(cls, EnvfleetError), f"{cls.__module__}.{cls.__qualname__} is outside the envfleet tree"


@pytest.mark.parametrize(
    "cls",
    [c for c in ERRORS if issubclass(c, EnvfleetError) and c is not EnvfleetError and not issubclass(c, CLASSIFYING)],
    ids=lambda c: c.__qualname__,
)
def test_every_answerable_error_has_a_status_of_its_base(cls: type[EnvfleetError]) -> None:
    # a leaf that only derives from the root would answer INTERNAL: it must pick a base that says what went wrong
    error = cls.__new__(cls)
    code = status_for(error)
    assert code is not None
    # client-side: a trainer adapter's failed episode, the OpenEnv facade's failed call to the orchestrator
    generic = {
        *("EvaluationError", "ScoringError", "SessionFailedError", "BuildError"),
        *("EpisodeFailedError", "OrchestratorCallError"),
    }
    if cls.__name__ not in generic:
        assert code != grpc.StatusCode.INTERNAL, f"{cls.__qualname__} maps to INTERNAL"
