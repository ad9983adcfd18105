"""The environment registry: `name@version` -> Environment, filled from the `envfleet.environments` entry points.

A registration is validated before use: a well-formed name and version, known tools, unique task ids.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.core.echo import echo
from orchestrator.core.environment import Environment
from orchestrator.core.errors import EnvironmentNotFoundError, InvalidEnvironmentError, InvalidRequestError
from orchestrator.core.tools import get_tools

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "envfleet.environments"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,31}$")


@dataclass(frozen=True)
class Registered:
    """One registered environment."""

    env: Environment
    source: str


def _version_key(v: str) -> tuple[int | str, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[._+-]", v))


class Registry:
    """Environments by name and version."""

    def __init__(self) -> None:
        self._by_name: dict[str, dict[str, Registered]] = {}

    @classmethod
    def from_entry_points(cls, group: str = ENTRY_POINT_GROUP) -> Registry:
        """Every environment installed packages declare; a broken plug-in is logged and skipped, not fatal."""
        reg = cls()
        for ep in importlib.metadata.entry_points(group=group):
            try:
                env_cls = ep.load()
                reg.register(env_cls(), source=f"entry-point:{ep.value}")
            except Exception:
                log.exception("environment entry point %s (%s) failed to load", ep.name, ep.value)
        return reg

    def load(self, reference: str) -> Environment:
        """Import `module:ClassName` (an Environment class outside any entry point: the operator's configuration,
        a benchmark, a test), register an instance and return it."""
        module, _, attr = reference.partition(":")
        if not module or not attr:
            raise InvalidEnvironmentError(f"environment reference {reference!r} must be module:ClassName")
        try:
            env_cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise InvalidEnvironmentError(f"environment reference {reference!r}: {e}") from None
        if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
            raise InvalidEnvironmentError(f"environment reference {reference!r} is not an Environment class")
        env = env_cls()
        self.register(env, source=f"reference:{reference}")
        return env

    def register(self, env: Environment, source: str = "python") -> None:
        """Validate and add an environment instance."""
        name, version = getattr(env, "name", ""), getattr(env, "version", "")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidEnvironmentError(f"environment name {echo(name)} must match {_NAME.pattern}")
        if not isinstance(version, str) or not _VERSION.match(version):
            raise InvalidEnvironmentError(f"{name}: version {echo(version)} must match {_VERSION.pattern}")
        try:
            get_tools(env.tools)
        except InvalidRequestError as e:
            raise InvalidEnvironmentError(f"{name}@{version}: {e}") from None
        if not hasattr(env, "rubric"):
            raise InvalidEnvironmentError(f"{name}@{version}: no rubric")
        ids = [t.id for t in env.tasks()]
        if len(set(ids)) != len(ids):
            raise InvalidEnvironmentError(f"{name}@{version}: task ids are not unique")
        self._by_name.setdefault(name, {})[version] = Registered(env, source)

    def get(self, ref: str) -> Environment:
        """The environment for `name` (latest version) or `name@version`."""
        return self.lookup(ref).env

    def lookup(self, ref: str) -> Registered:
        """Like get, with where it came from."""
        name, _, version = ref.partition("@")
        versions = self._by_name.get(name)
        if not versions:
            close = difflib.get_close_matches(name, list(self._by_name), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(self._by_name))}"
            raise EnvironmentNotFoundError(f"no environment named {echo(name)}{hint}")
        if not version:
            return versions[max(versions, key=_version_key)]
        if version not in versions:
            raise EnvironmentNotFoundError(
                f"{echo(name)} has no version {echo(version)}; versions: {', '.join(sorted(versions))}"
            )
        return versions[version]

    def all(self) -> Iterable[Registered]:
        """Every registered environment, by name then version."""
        for name in sorted(self._by_name):
            for version in sorted(self._by_name[name], key=_version_key):
                yield self._by_name[name][version]
