"""The environment registry: `name@version` -> Environment, filled from the `envfleet.environments` entry points.

A registration is validated before use: a well-formed name and version, known tools (built-in names, or its own
Tools, checked), a rubric that pays, async hooks, no misspelt setting, and a task list of Tasks with unique ids.

An environment is public (built-in entry points, the operator's references, specs registered as public) or private to
the tenant that registered it: a lookup on behalf of another tenant reports a private environment exactly like a
missing one, and a listing leaves it out.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import logging
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.core.echo import echo
from orchestrator.core.environment import Environment, Task
from orchestrator.core.errors import EnvironmentNotFoundError, InvalidEnvironmentError, InvalidRequestError
from orchestrator.core.tools import get_tools

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "envfleet.environments"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,31}$")
MAX_TURNS = 1000  # as a job's and a declarative spec's max_turns
# the names an unknown name's error lists when none is close: every visible one made a message of megabytes
KNOWN_IN_HINT = 20
MAX_TOOL_TIMEOUT_S = 3600.0  # as a declarative spec's tool_timeout_s


@dataclass(frozen=True)
class Registered:
    """One registered environment."""

    env: Environment
    source: str
    owner: str | None = None  # the tenant a private environment belongs to; None: public

    def visible_to(self, tenant: str | None) -> bool:
        """Whether `tenant` may see and use it (None: the operator, who sees everything)."""
        return self.owner is None or tenant is None or self.owner == tenant


def _ours(ep: importlib.metadata.EntryPoint) -> bool:
    dist = getattr(ep, "dist", None)
    return dist is not None and dist.name == "envfleet"


def _refuse_misspelt(env: Environment, ref: str) -> None:
    """A class attribute named like a setting its class does not set, holding what that setting holds: a misspelling
    (`max_turn = 40`, `tool = (...)`). An attribute of another kind (`limit = 10`, where `limits` holds a Limits), or
    one beside the setting it resembles in its own class (`names` beside `name`), is the author's own."""
    mro = type(env).__mro__
    for klass in mro[: mro.index(Environment)]:
        for attr, value in vars(klass).items():
            method = callable(value) or isinstance(value, property | classmethod | staticmethod)
            if attr.startswith("_") or attr in _SETTINGS or method:
                continue
            for close in difflib.get_close_matches(attr, _SETTINGS, n=1, cutoff=0.85):
                if close not in vars(klass) and _alike(value, _KINDS.get(close, object)):
                    raise InvalidEnvironmentError(
                        f"{ref}: {klass.__name__}.{attr} is no setting of an Environment; did you mean {close!r}?"
                    )


def _kinds() -> dict[str, type]:
    hints = typing.get_type_hints(Environment)
    inner = {k: typing.get_args(v)[0] if typing.get_origin(v) is typing.ClassVar else v for k, v in hints.items()}
    return {k: typing.get_origin(v) or v for k, v in inner.items()}  # tuple[...] is a tuple


_KINDS = _kinds()  # each setting's kind: str, int, float, tuple, Limits, Rubric...
# what an environment class sets: an attribute named close to one of these, holding its kind, where its class sets
# no such setting, is a misspelling (_refuse_misspelt), whose setting was silently the default (`max_turn = 40`)
_SETTINGS = frozenset(_KINDS)


def _alike(value: object, kind: type) -> bool:
    if kind is float:  # an int where a float goes (tool_timeout_s = 60)
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, kind)


def _check_tasks(env: Environment, ref: str) -> None:
    """The task list: Task objects with unique ids and a prompt (a reference that calls a tool the environment does
    not offer is the checker's to report: a reference runs in checks and scripted runs only)."""
    try:
        tasks = list(env.tasks())
    except TypeError as e:
        raise InvalidEnvironmentError(f"{ref}: tasks() must return a sequence of Task: {e}") from None
    if not tasks:
        raise InvalidEnvironmentError(f"{ref}: tasks() returned no tasks")
    for i, t in enumerate(tasks):
        if not isinstance(t, Task):
            raise InvalidEnvironmentError(f"{ref}: tasks()[{i}] is {echo(t)}, not a Task")
        if not isinstance(t.id, str) or not t.id or not isinstance(t.prompt, str):
            raise InvalidEnvironmentError(f"{ref}: task {i} needs a non-empty string id and a string prompt")
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise InvalidEnvironmentError(f"{ref}: task ids are not unique")


def _version_key(v: str) -> tuple[tuple[int, int, str], ...]:
    """Versions in order, part by part: numbers by value, before words (1 < 2 < 10 < a). Every key compares with
    every other: `1` and `a` side by side once made sorting raise, and every registration after failed."""
    return tuple((0, int(p), "") if p.isascii() and p.isdigit() else (1, 0, p) for p in re.split(r"[._+-]", v))


class Registry:
    """Environments by name and version."""

    def __init__(self) -> None:
        self._by_name: dict[str, dict[str, Registered]] = {}

    @classmethod
    def from_entry_points(cls, group: str = ENTRY_POINT_GROUP) -> Registry:
        """Every environment installed packages declare; a broken plug-in is logged and skipped, not fatal."""
        reg = cls()
        # envfleet's own first: a plug-in's copy of a built-in not renamed is then the one refused, whatever order the
        # installed packages' entry points come in
        points = sorted(importlib.metadata.entry_points(group=group), key=lambda ep: not _ours(ep))
        for ep in points:
            try:
                env = ep.load()()
                reg._refuse_another(env, f"entry-point:{ep.value}")
                reg.register(env, source=f"entry-point:{ep.value}")
            except Exception:
                log.exception("environment entry point %s (%s) failed to load", ep.name, ep.value)
                continue
            if ep.name != env.name:
                log.warning(
                    "environment entry point %s (%s) registers %s: the entry point's name is not used",
                    ep.name,
                    ep.value,
                    env.ref(),
                )
        return reg

    def _refuse_another(self, env: Environment, source: str) -> None:
        """InvalidEnvironmentError when `name@version` is registered from another source as another class: the one
        read last silently took the other's place (a copy of python-tool not renamed replaced the built-in, or the
        other way round, in the order the entry points were read). The same class by another way (a configuration's
        reference to a built-in) is the same environment."""
        name, version = getattr(env, "name", ""), getattr(env, "version", "")
        held = self._by_name.get(name, {}).get(version) if isinstance(name, str) else None
        if held is not None and held.source != source and type(held.env) is not type(env):
            raise InvalidEnvironmentError(
                f"{name}@{version} from {source} is already registered from {held.source}: give one another name "
                "or version"
            )

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
        self._refuse_another(env, f"reference:{reference}")
        self.register(env, source=f"reference:{reference}")
        return env

    def register(self, env: Environment, source: str = "python", owner: str | None = None) -> None:
        """Validate and add an environment instance; with `owner`, private to that tenant."""
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
        rubric = env.rubric
        scorer = not isinstance(rubric, type) and inspect.iscoroutinefunction(getattr(rubric, "score", None))
        if type(env).score is Environment.score and not scorer:
            # a list of (name, fn, weight) registered, listed and described as fine, and failed every rollout
            shown = echo(rubric) if isinstance(rubric, type) else f"a {type(rubric).__name__}"
            raise InvalidEnvironmentError(
                f"{name}@{version}: rubric is {shown} with no async score(ctx); write Rubric([(name, fn, weight), ...])"
            )
        turns, tool_s = getattr(env, "max_turns", None), getattr(env, "tool_timeout_s", None)
        if isinstance(turns, bool) or not isinstance(turns, int) or not 1 <= turns <= MAX_TURNS:
            raise InvalidEnvironmentError(f"{name}@{version}: max_turns {echo(turns)} must be an int in 1..{MAX_TURNS}")
        if isinstance(tool_s, bool) or not isinstance(tool_s, int | float) or not 0 < tool_s <= MAX_TOOL_TIMEOUT_S:
            raise InvalidEnvironmentError(
                f"{name}@{version}: tool_timeout_s {echo(tool_s)} must be a number in (0, {MAX_TOOL_TIMEOUT_S:g}]"
            )
        if type(env).score is Environment.score and not getattr(rubric, "pays", True):
            raise InvalidEnvironmentError(
                f"{name}@{version}: no rubric function has a weight, so every episode would score 0; give the reward's "
                "functions a non-zero weight (a weight of 0 makes a metric)"
            )
        for hook in ("setup", "score"):
            if not inspect.iscoroutinefunction(getattr(type(env), hook)):
                raise InvalidEnvironmentError(f"{name}@{version}: {hook} must be an async def (a coroutine function)")
        _refuse_misspelt(env, f"{name}@{version}")
        _check_tasks(env, f"{name}@{version}")
        self._by_name.setdefault(name, {})[version] = Registered(env, source, owner)

    def get(self, ref: str, tenant: str | None = None) -> Environment:
        """The environment for `name` (latest version) or `name@version`, as `tenant` sees it (None: every one)."""
        return self.lookup(ref, tenant).env

    def _visible(self, tenant: str | None) -> dict[str, dict[str, Registered]]:
        if tenant is None:
            return self._by_name
        seen = {
            name: {v: r for v, r in versions.items() if r.visible_to(tenant)}
            for name, versions in self._by_name.items()
        }
        return {name: versions for name, versions in seen.items() if versions}

    def lookup(self, ref: str, tenant: str | None = None) -> Registered:
        """Like get, with where it came from."""
        name, _, version = ref.partition("@")
        versions = {v: r for v, r in self._by_name.get(name, {}).items() if r.visible_to(tenant)}
        if not versions:
            by_name = self._visible(tenant)
            close = difflib.get_close_matches(name, list(by_name), n=3, cutoff=0.5)
            known = sorted(by_name)
            listed = ", ".join(known[:KNOWN_IN_HINT]) + (
                f" and {len(known) - KNOWN_IN_HINT} more (EnvironmentService.List)"
                if len(known) > KNOWN_IN_HINT
                else ""
            )
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {listed}"
            raise EnvironmentNotFoundError(f"no environment named {echo(name)}{hint}")
        if not version:
            return versions[max(versions, key=_version_key)]
        if version not in versions:
            raise EnvironmentNotFoundError(
                f"{echo(name)} has no version {echo(version)}; versions: {', '.join(sorted(versions))}"
            )
        return versions[version]

    def all(self, tenant: str | None = None) -> Iterable[Registered]:
        """Every registered environment `tenant` may see (None: every one), by name then version."""
        by_name = self._visible(tenant)
        for name in sorted(by_name):
            for version in sorted(by_name[name], key=_version_key):
                yield by_name[name][version]
