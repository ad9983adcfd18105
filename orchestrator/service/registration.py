"""Declarative registration: validate an EnvironmentSpec for real (build, load, run the reference through scoring),
then persist it and add it to the registry, all or nothing. Registered specs are reloaded at every start.

Names belong to the tenant that first registered them; built-in (entry-point) names belong to the operator.
A name@version is immutable: registering it again with the same spec is a no-op, with another spec ALREADY_EXISTS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from orchestrator.core.errors import (
    AlreadyExistsError,
    EnvironmentBroken,
    ImageBuildError,
    PermissionDeniedError,
    SandboxCreateError,
)
from orchestrator.core.sandbox import DETERMINISTIC_ENV, SandboxBackend, SandboxSpec
from orchestrator.rollout.step import env_call, replay_reference
from orchestrator.service.caps import SandboxCaps, check_limits
from orchestrator.service.declarative import (
    DeclarativeEnvironment,
    EnvironmentSpec,
    Problem,
    SpecCheckError,
    make_environment,
)
from orchestrator.service.registry import Registered, Registry
from orchestrator.service.tenancy import LOCAL_TENANT, TenantGate

log = logging.getLogger(__name__)

SPEC_SOURCE = "spec"
VALIDATION_SANDBOX_TTL_S = 3600.0
VALIDATION_SLACK_S = 60.0


def _owner(spec: EnvironmentSpec, tenant: str) -> str | None:
    """Who may use a registered spec: its tenant alone, or (None) everyone when it was registered public."""
    return None if spec.visibility == "public" else tenant


class StoredSpec(BaseModel):
    """A registered spec as persisted: who registered it, when, and the spec itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    owner: str
    registered_at: float
    spec: EnvironmentSpec


class SpecStore:
    """One JSON file per name@version under a folder; written atomically (temp file, fsync, rename)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, ref: str) -> Path:
        return self.root / f"{ref}.json"

    def save(self, record: StoredSpec) -> None:
        """Persist a record (replacing one of the same name@version)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(record.model_dump_json(indent=1))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(record.spec.ref()))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def delete(self, ref: str) -> None:
        """Forget a record (if present)."""
        with contextlib.suppress(FileNotFoundError):
            self._path(ref).unlink()

    def load_all(self) -> list[StoredSpec]:
        """Every readable record, oldest registration first; unreadable files are logged and skipped."""
        records = []
        for path in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            try:
                records.append(StoredSpec.model_validate_json(path.read_bytes()))
            except (OSError, ValidationError) as e:
                log.error("skipping unreadable environment spec %s: %s", path, e)
        return sorted(records, key=lambda r: r.registered_at)


@dataclass
class ValidationResult:
    """What Validate checked and found."""

    env: str
    image: str
    num_tasks: int
    reference_task_id: str = ""
    reference_reward: float | None = None
    reference_components: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    checks: list[str] = field(default_factory=list)


class Registrar:
    """Validates, registers and reloads declarative environments."""

    def __init__(
        self,
        registry: Registry,
        backend: SandboxBackend,
        build_image: Callable[[DeclarativeEnvironment], str],
        store: SpecStore,
        max_concurrent_checks: int = 2,
        max_checks_per_tenant: int = 1,
        caps: SandboxCaps | None = None,
    ) -> None:
        self._registry = registry
        self._caps = caps or SandboxCaps()
        self._backend = backend
        self._build_image = build_image  # blocking (run in a thread): the backend's way to get a spec's image
        self._store = store
        # builds and reference runs are tenant content: counted per tenant, so one cannot hold every slot
        self._checks = TenantGate(max_concurrent_checks, min(max_checks_per_tenant, max_concurrent_checks))
        self._owners: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def load(self) -> int:
        """Register every persisted spec; returns how many. A spec the registry refuses is logged, not fatal."""
        count = 0
        for record in await asyncio.to_thread(self._store.load_all):
            try:
                self._registry.register(
                    make_environment(record.spec), source=SPEC_SOURCE, owner=_owner(record.spec, record.owner)
                )
            except Exception:
                log.exception("could not reload environment %s", record.spec.ref())
                continue
            self._owners.setdefault(record.spec.name, record.owner)
            count += 1
        if count:
            log.info("reloaded %d registered environment spec(s)", count)
        return count

    def _existing(self, spec: EnvironmentSpec, tenant: str) -> Registered | None:
        """The registration this spec repeats, if any; raises when the name or version is not the tenant's to use."""
        owner = self._owners.get(spec.name)
        known = {r.env.name for r in self._registry.all()}
        if owner is None and spec.name in known:
            raise PermissionDeniedError(f"{spec.name!r} is a built-in environment of this server; choose another name")
        if owner is not None and owner != tenant:
            raise PermissionDeniedError(f"environment {spec.name!r} belongs to another tenant; choose another name")
        for r in self._registry.all():
            if r.env.name == spec.name and r.env.version == spec.version:
                if isinstance(r.env, DeclarativeEnvironment) and r.env.spec == spec:
                    return r
                raise AlreadyExistsError(
                    f"{spec.ref()} is already registered with a different spec; registered versions are immutable, "
                    "so bump the version"
                )
        return None

    async def validate(self, spec: EnvironmentSpec, tenant: str = LOCAL_TENANT) -> ValidationResult:
        """Build the image, load the tasks and run a reference solution (or an empty episode) through scoring.

        SpecCheckError (FAILED_PRECONDITION) lists what failed; SandboxError means the fleet itself failed.
        """
        started = time.monotonic()
        check_limits(spec.limits, self._caps, runtime=spec.runtime)  # before anything is built
        env = make_environment(spec)
        result = ValidationResult(env=spec.ref(), image="", num_tasks=len(env.tasks()))
        result.checks.append(f"spec: {result.num_tasks} task(s), tools {', '.join(spec.tools)}")
        async with self._checks.slot(tenant):
            try:
                result.image = await asyncio.to_thread(self._build_image, env)
            except ImageBuildError as e:
                where = "image.dockerfile" if spec.image.dockerfile is not None else "image"
                raise SpecCheckError([Problem(where, f"the image does not build: {e}")]) from None
            result.checks.append(f"image: {result.image}")
            await self._run_reference(env, spec, result)
        result.duration_s = time.monotonic() - started
        return result

    async def _run_reference(
        self, env: DeclarativeEnvironment, spec: EnvironmentSpec, result: ValidationResult
    ) -> None:
        index, task = next(((i, t) for i, t in enumerate(env.tasks()) if t.reference), (0, env.tasks()[0]))
        where = f"tasks[{index}].reference"
        budget = spec.tool_timeout_s * (len(task.reference) + 1) + spec.scoring.timeout_s + VALIDATION_SLACK_S
        try:
            sandbox = await self._backend.create(
                SandboxSpec(
                    image=result.image,
                    limits=spec.limits,
                    runtime=spec.runtime,
                    env=dict(DETERMINISTIC_ENV),
                    labels={"envfleet.validate": spec.ref()},
                    ttl_s=VALIDATION_SANDBOX_TTL_S,
                )
            )
        except SandboxCreateError as e:
            problem = f"a sandbox of the image did not start (does its final stage keep envd intact?): {e}"
            raise SpecCheckError([Problem("image", problem)]) from None
        try:
            async with asyncio.timeout(budget):
                try:
                    await env_call(env.setup(sandbox, task, 0))
                except EnvironmentBroken as e:
                    raise SpecCheckError([Problem("setup_command", str(e.__cause__ or e))]) from None
                episode = await replay_reference(env, sandbox, task)
                try:
                    score = await env_call(env.score(sandbox, task, episode))
                except EnvironmentBroken as e:
                    problem = f"on task {task.id!r}: {e.__cause__ or e}"
                    raise SpecCheckError([Problem("scoring.command", problem)]) from None
        except TimeoutError:
            raise SpecCheckError([Problem(where, f"the check did not finish within {budget:g}s")]) from None
        finally:
            await sandbox.close()
        if not task.reference:
            result.checks.append(f"scoring: an empty episode of task {task.id} scored {score.reward:g}")
            return
        result.reference_task_id, result.reference_reward = task.id, score.reward
        result.reference_components = score.components
        if score.reward < spec.scoring.min_reference_reward:
            raise SpecCheckError(
                [
                    Problem(
                        where,
                        f"the reference solution of task {task.id!r} scored {score.reward:g}, below "
                        f"scoring.min_reference_reward {spec.scoring.min_reference_reward:g}",
                    )
                ]
            )
        result.checks.append(f"reference: task {task.id} scored {score.reward:g}")

    async def register(self, spec: EnvironmentSpec, tenant: str) -> Registered:
        """Validate, persist, add to the registry; nothing is left behind when a step fails."""
        async with self._locks.setdefault(spec.name, asyncio.Lock()):
            existing = self._existing(spec, tenant)
            if existing is not None:
                return existing
            await self.validate(spec, tenant)
            record = StoredSpec(owner=tenant, registered_at=time.time(), spec=spec)
            await asyncio.to_thread(self._store.save, record)
            try:
                self._registry.register(make_environment(spec), source=SPEC_SOURCE, owner=_owner(spec, tenant))
            except BaseException:
                await asyncio.to_thread(self._store.delete, spec.ref())
                raise
            self._owners.setdefault(spec.name, tenant)
            log.info("tenant %s registered %s", tenant, spec.ref())
            return self._registry.lookup(spec.ref())
