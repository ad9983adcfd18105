"""Registration: validate an EnvironmentSpec for real (build, load, run the reference through scoring), or an
uploaded archive of a plug-in's kind (unpack safely, load, build, run each task's reference and an empty solution),
then persist it and add it to the registry, all or nothing. Registered specs and archives are reloaded at every start.

Names belong to the tenant that first registered them; built-in (entry-point) names belong to the operator.
A name@version is immutable: registering it again with the same spec is a no-op, with another spec ALREADY_EXISTS.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from orchestrator.core.archives import ArchiveKind, TaskValidation
from orchestrator.core.echo import error_text
from orchestrator.core.environment import Environment
from orchestrator.core.errors import (
    AlreadyExistsError,
    ArchiveTooLargeError,
    EnvironmentBroken,
    FailedPreconditionError,
    ImageBuildError,
    InvalidEnvironmentError,
    InvalidRequestError,
    PermissionDeniedError,
    SandboxCreateError,
)
from orchestrator.core.files import sweep_temporaries, write_atomically
from orchestrator.core.runtime import to_the_end
from orchestrator.core.sandbox import DETERMINISTIC_ENV, SandboxBackend, SandboxSpec
from orchestrator.core.tools import tool_names
from orchestrator.images.resolver import BuildsOwnImage
from orchestrator.rollout.step import env_call, env_score, replay_reference
from orchestrator.service.archives import (
    ArchiveCatalog,
    ArchiveStore,
    ArchiveUpload,
    Shipment,
    StoredArchive,
    claim_in,
)
from orchestrator.service.caps import (
    WIDEST_ARCHIVE_LIMITS,
    ArchiveCaps,
    CapsConfig,
    SandboxCaps,
    TenantCounter,
    check_limits,
)
from orchestrator.service.declarative import (
    DeclarativeEnvironment,
    EnvironmentSpec,
    Problem,
    SpecCheckError,
    make_environment,
)
from orchestrator.service.declarative.env import late_metrics, strict_scoring
from orchestrator.service.registry import Registered, Registry
from orchestrator.service.tenancy import LOCAL_TENANT, TenantGate

log = logging.getLogger(__name__)

SPEC_SOURCE = "spec"
ARCHIVE_SOURCE = "archive:"  # + the kind
VALIDATION_SANDBOX_TTL_S = 3600.0
VALIDATION_SLACK_S = 60.0
CHECK_BUILD_THREADS = 4  # checks' builds at once: the checks running (2 by default) and cut-off ones still building


def _owner(spec: EnvironmentSpec, tenant: str) -> str | None:
    """Who may use a registered spec: its tenant alone, or (None) everyone when it was registered public."""
    return None if spec.visibility == "public" else tenant


def _spec_bytes(spec: EnvironmentSpec) -> int:
    """What a spec counts against caps.spec_bytes_per_tenant: its JSON."""
    return len(spec.model_dump_json())


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


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
        write_atomically(self._path(record.spec.ref()), record.model_dump_json(indent=1).encode())

    def delete(self, ref: str) -> None:
        """Forget a record (if present)."""
        with contextlib.suppress(FileNotFoundError):
            self._path(ref).unlink()

    def load_all(self) -> list[StoredSpec]:
        """Every readable record, oldest registration first; unreadable files are logged and skipped, and their names'
        owners, where the file says them, are kept in `unreadable` (name -> owner)."""
        records = []
        self.unreadable: dict[str, str] = {}
        if self.root.is_dir():
            sweep_temporaries(self.root)  # a save killed before its rename; never a registration
        for path in sorted(self.root.glob("[!.]*.json")) if self.root.is_dir() else []:
            try:
                records.append(StoredSpec.model_validate_json(path.read_bytes()))
            except (OSError, ValidationError) as e:
                log.error("skipping unreadable environment spec %s: %s", path, error_text(e))
                claim = claim_in(path, ("spec", "name"))
                if claim is not None:
                    self.unreadable.setdefault(*claim)
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
    tasks: list[TaskValidation] = field(default_factory=list)  # an archive's tasks, each checked


# what may pass by the next start: the disk full or failing, a read-only remount, too many open files, memory
_PASSING_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EMFILE, errno.ENFILE, errno.ENOMEM}
)


def _passing(e: BaseException | None) -> bool:
    """Whether a reload failed for what may pass by the next start (_PASSING_ERRNOS), anywhere in the exception's
    chain as Python shows it. A file gone (ENOENT: an archive deleted by hand) is no passing failure."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in _PASSING_ERRNOS:
            return True
        e = e.__cause__ if e.__cause__ is not None or e.__suppress_context__ else e.__context__
    return False


def _shadowed(ref: str, owner: str) -> None:
    log.error(
        "not loading environment %s of tenant %s: a built-in environment of this server has its name (the tenant "
        "registered it before the built-in was installed); it stays on disk, and the tenant can register it again "
        "under another name",
        ref,
        owner,
    )


# the calls a tenant may have waiting for its check slots (Registrar.admitted)
MAX_WAITING_CHECKS = 4


class Registrar:
    """Validates, registers and reloads declarative environments and uploaded archives."""

    def __init__(
        self,
        registry: Registry,
        backend: SandboxBackend,
        build_image: Callable[[BuildsOwnImage], str],
        store: SpecStore,
        max_concurrent_checks: int = 2,
        max_checks_per_tenant: int = 1,
        caps: SandboxCaps | None = None,
        archives: ArchiveStore | None = None,
        archive_caps: ArchiveCaps | None = None,
        kinds: Mapping[str, ArchiveKind] | None = None,
        spec_bytes_per_tenant: int = CapsConfig().spec_bytes_per_tenant,
        check_s: float = CapsConfig().registration_check_s,
        environments_per_tenant: int = CapsConfig().environments_per_tenant,
    ) -> None:
        self._registry = registry
        # a check's time in all (build, reference runs, an archive's every task): its budgets come from the tenant's
        # own spec (up to 101 x 3600 s), so without this two tenants held both check slots for days
        self._check_s = check_s
        self._caps = caps or SandboxCaps()
        self._backend = backend
        self._build_image = build_image  # blocking (run in a thread): the backend's way to get a spec's image
        # checks' builds (a cut-off check's runs on, up to its 15 minutes) on threads of their own: on asyncio's
        # shared pool (6 threads on 2 cores) a few tenants' cut-off checks held every thread, and the rest of the
        # process (each sandbox's create, the sweep, SubmitJob) waited behind them
        self._build_pool = concurrent.futures.ThreadPoolExecutor(CHECK_BUILD_THREADS, thread_name_prefix="check-build")
        self._store = store
        self._archives = archives or ArchiveStore(store.root / "archives")
        self._archive_caps = archive_caps or ArchiveCaps()
        self._kinds = dict(kinds or {})
        self.catalog = ArchiveCatalog()  # which registered environments the worker hub ships as archives
        # builds and reference runs are tenant content: counted per tenant, so one cannot hold every slot
        self._checks = TenantGate(max_concurrent_checks, min(max_checks_per_tenant, max_concurrent_checks))
        # the calls a tenant has under way, waiting for its slot included: each holds its request (a spec of up to
        # 64 MiB, some hundreds of MiB once converted), and a dozen queued behind one slow check took 4.4 GiB
        self._admitted = TenantCounter(
            self._checks.per_tenant + MAX_WAITING_CHECKS,
            f"environment checks a tenant runs or waits for (Register, Validate and their archive forms: its "
            f"{self._checks.per_tenant} check slot(s) and {MAX_WAITING_CHECKS} waiting)",
            "environment check(s) under way",
        )
        self._owners: dict[str, str] = {}
        # a lock per name while a registration of it runs or waits: kept for every name ever tried, a tenant's loop
        # of refused registrations under fresh names grew it without end
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._cut_builds: dict[str, set[asyncio.Future[str]]] = {}  # builds of checks cut off, by tenant (_built)
        # the names of registered environments whose reload failed at this start for a passing reason (the disk: full,
        # unreadable; _passing): their unfinished jobs wait for a start that loads them (JobManager.start's
        # `held_envs`). One that failed otherwise (a check tightened since, its plug-in gone) is as good as gone
        self.unloaded: set[str] = set()
        self._kept = TenantCounter(
            environments_per_tenant, "caps.environments_per_tenant", "environments registered (versions count)"
        )
        # the JSON bytes of the specs each tenant keeps registered, all held in memory: capped like its archives
        self._spec_bytes = TenantCounter(
            spec_bytes_per_tenant, "caps.spec_bytes_per_tenant", "bytes of registered specs"
        )

    async def load(self) -> int:
        """Register every persisted spec; returns how many. A spec the registry refuses is logged, not fatal."""
        count = 0
        # the server's own environments (installed plug-ins, the operator's), registered before this: a tenant's
        # saved one of the same name is not loaded. Registered first and then installed as a built-in, it replaced
        # the built-in for every tenant (and its jobs) at the next start
        builtins = {r.env.name for r in self._registry.all()}
        records = await asyncio.to_thread(self._store.load_all)
        for record in records:
            if record.spec.name in builtins:
                _shadowed(record.spec.ref(), record.owner)
                continue
            try:
                self._registry.register(
                    make_environment(record.spec), source=SPEC_SOURCE, owner=_owner(record.spec, record.owner)
                )
            except Exception as e:
                log.exception("could not reload environment %s", record.spec.ref())
                self._owners.setdefault(record.spec.name, record.owner)  # its name stays its owner's
                if _passing(e):
                    self.unloaded.add(record.spec.name)
                continue
            self._owners.setdefault(record.spec.name, record.owner)
            self._spec_bytes.add(record.owner, _spec_bytes(record.spec))
            self._kept.add(record.owner, 1)
            count += 1
        await asyncio.to_thread(self._archives.sweep)
        archives = await asyncio.to_thread(self._archives.load_all)
        for stored in archives:
            if stored.name in builtins:
                _shadowed(stored.ref(), stored.owner)
                continue
            try:
                await self._reload_archive(stored)
            except Exception as e:
                log.exception("could not reload environment archive %s of %s", stored.ref(), stored.owner)
                self._owners.setdefault(stored.name, stored.owner)  # its name stays its owner's
                if _passing(e):
                    self.unloaded.add(stored.name)
                continue
            count += 1
        # the names of records that no longer load (a check tightened since) stay their owners', after those that
        # load: a name read as another tenant's is theirs
        for name, owner in (*self._store.unreadable.items(), *self._archives.unreadable.items()):
            if name not in builtins and self._owners.setdefault(name, owner) != owner:
                log.warning(
                    "environment name %r: an unreadable record of %s names it, a readable one of %s",
                    name,
                    owner,
                    self._owners[name],
                )
        if count:
            log.info("reloaded %d registered environment(s)", count)
        return count

    async def _reload_archive(self, stored: StoredArchive) -> None:
        kind = self._kind(stored.kind)
        dest = await asyncio.to_thread(self._archives.tree, stored.owner, stored.ref())
        path = self._archives.archive_path(stored)
        # checked when it was registered: the caps in force now may be lower, and it stays registered
        env = await asyncio.to_thread(kind.load, path, dest, stored.name, stored.version, WIDEST_ARCHIVE_LIMITS)
        self._add_archive(env, stored, path)

    def registered_by(self, name: str) -> str | None:
        """The tenant that registered environments named `name` (None: a built-in, or none of that name)."""
        return self._owners.get(name)

    def _claim(self, name: str, version: str, tenant: str, same: Callable[[Registered], bool]) -> Registered | None:
        """The registration of name@version that `same` says this one repeats, if any; raises when the name is not
        the tenant's to use or the version is taken by something else."""
        owner = self._owners.get(name)
        known = {r.env.name for r in self._registry.all()}
        if owner is None and name in known:
            raise PermissionDeniedError(f"{name!r} is a built-in environment of this server; choose another name")
        if owner is not None and owner != tenant:
            raise PermissionDeniedError(f"environment {name!r} belongs to another tenant; choose another name")
        for r in self._registry.all():
            if r.env.name == name and r.env.version == version:
                if same(r):
                    return r
                raise AlreadyExistsError(
                    f"{name}@{version} is already registered with different content; registered versions are "
                    "immutable, so bump the version"
                )
        return None

    def _existing(self, spec: EnvironmentSpec, tenant: str) -> Registered | None:
        """The registration this spec repeats, if any; raises when the name or version is not the tenant's to use."""
        return self._claim(
            spec.name,
            spec.version,
            tenant,
            lambda r: isinstance(r.env, DeclarativeEnvironment) and r.env.spec == spec,
        )

    def admitted(self, tenant: str) -> contextlib.AbstractContextManager[None]:
        """Hold one of the tenant's admissions for a registration call, its request's conversion included: a
        BusyError (RESOURCE_EXHAUSTED, worth asking again) past its check slots and MAX_WAITING_CHECKS waiting."""
        return self._admitted.hold(tenant)

    async def validate(self, spec: EnvironmentSpec, tenant: str = LOCAL_TENANT) -> ValidationResult:
        """Build the image, load the tasks and run a reference solution (or an empty episode) through scoring.

        SpecCheckError (FAILED_PRECONDITION) lists what failed; SandboxError means the fleet itself failed.
        """
        async with self._checks.slot(tenant):
            return await self._validated(spec, tenant)

    @contextlib.asynccontextmanager
    async def _name_lock(self, name: str) -> AsyncIterator[None]:
        """Registrations of one name, one at a time; the lock is dropped when none runs or waits."""
        lock, users = self._locks.get(name, (asyncio.Lock(), 0))
        self._locks[name] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[name]
            if users == 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)

    @contextlib.asynccontextmanager
    async def _check_time(self, where: str) -> AsyncIterator[None]:
        """A check's steps, cut off at caps.registration_check_s (SpecCheckError at `where`)."""
        try:
            async with asyncio.timeout(self._check_s):
                yield
        except TimeoutError:
            problem = f"the checks did not finish within caps.registration_check_s = {self._check_s:g}s"
            raise SpecCheckError([Problem(where, problem)]) from None

    async def _validated(self, spec: EnvironmentSpec, tenant: str) -> ValidationResult:
        """Validate's checks, in a check slot of the tenant's that the caller holds."""
        async with self._check_time("spec"):
            return await self._validated_steps(spec, tenant)

    async def _built(self, env: BuildsOwnImage, tenant: str) -> str:
        """The environment's image, built in a thread, once the tenant's builds of earlier checks have ended.

        A check cut off (its time out, its caller gone) cannot stop its build's thread, which runs on to the
        build's own limits. Its slot was free at once, so a tenant that cancelled a Validate every 0.2 s ran five
        builds at a time on one slot, each reserving its disk and memory, and filled the threads every call of the
        control plane shares. The tenant's next check waits for those builds first (within its own time)."""
        earlier = self._cut_builds.get(tenant)
        if earlier:
            await asyncio.wait(set(earlier))
        queued = self._build_pool.submit(self._build_image, env)
        build = asyncio.wrap_future(queued)
        try:
            return await asyncio.shield(build)
        except asyncio.CancelledError:
            # still waiting for a thread: it never runs (cut there, it ran later all the same, for no one)
            if not queued.cancel() and not build.done():
                cut = self._cut_builds.setdefault(tenant, set())
                cut.add(build)
                build.add_done_callback(functools.partial(self._build_ended, tenant))
            raise

    def _build_ended(self, tenant: str, build: asyncio.Future[str]) -> None:
        cut = self._cut_builds.get(tenant, set())
        cut.discard(build)
        if not cut:
            self._cut_builds.pop(tenant, None)
        if not build.cancelled() and build.exception() is not None:  # nobody awaits it: its failure is seen here
            log.info("a build of %s's cut-off check ended: %s", tenant, build.exception())

    async def _validated_steps(self, spec: EnvironmentSpec, tenant: str) -> ValidationResult:
        started = time.monotonic()
        check_limits(spec.limits, self._caps, runtime=spec.runtime)  # before anything is built
        env = make_environment(spec)
        result = ValidationResult(env=spec.ref(), image="", num_tasks=len(env.tasks()))
        result.checks.append(f"spec: {result.num_tasks} task(s), tools {', '.join(spec.tools)}")
        try:
            result.image = await self._built(env, tenant)
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
        budget = spec.tool_timeout_s * (len(task.reference) + 1) + env.scoring_timeout_s(task) + VALIDATION_SLACK_S
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
                    with strict_scoring():
                        score = await env_score(env, sandbox, task, episode)
                except EnvironmentBroken as e:
                    problem = f"on task {task.id!r}: {e.__cause__ or e}"
                    raise SpecCheckError([Problem("scoring.command", problem)]) from None
                if late_metrics(score):
                    # a rollout's scoring gives such a run a 0, or its second run's score: the policy's program
                    # may be why there, not here
                    problem = f"on task {task.id!r}: it ran past scoring.timeout_s = {spec.scoring.timeout_s:g}s"
                    raise SpecCheckError([Problem("scoring.command", problem)])
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
        async with self._name_lock(spec.name):
            existing = self._existing(spec, tenant)
            if existing is not None:
                return existing
            size = _spec_bytes(spec)
            async with self._checks.slot(tenant):  # a tenant's checks are serialized: so is the growth of its tally
                self._kept.check(tenant)
                self._spec_bytes.check(tenant, size)
                await self._validated(spec, tenant)
                # to its end once begun, the name still locked: a call cancelled while the file was saved left it on
                # disk, unregistered and uncounted, and the next start loaded it past the tenant's cap
                await to_the_end(asyncio.ensure_future(self._keep(spec, tenant, size)))
            log.info("tenant %s registered %s", tenant, spec.ref())
            return self._registry.lookup(spec.ref())

    async def _keep(self, spec: EnvironmentSpec, tenant: str, size: int) -> None:
        """Save a checked spec, add it to the registry, count it and its name's owner; nothing is kept when a step
        fails."""
        record = StoredSpec(owner=tenant, registered_at=time.time(), spec=spec)
        await asyncio.to_thread(self._store.save, record)
        try:
            self._registry.register(make_environment(spec), source=SPEC_SOURCE, owner=_owner(spec, tenant))
        except BaseException:
            await asyncio.to_thread(self._store.delete, spec.ref())
            raise
        self._spec_bytes.add(tenant, size)
        self._kept.add(tenant, 1)
        self._owners.setdefault(spec.name, tenant)

    # -- uploaded archives ---------------------------------------------------------------------------------------

    def _kind(self, name: str) -> ArchiveKind:
        kind = self._kinds.get(name)
        if kind is None:
            known = ", ".join(sorted(self._kinds)) or "none"
            raise InvalidRequestError(f"this server reads no archives of kind {name!r}; it reads: {known}")
        return kind

    def _check_size(self, upload: ArchiveUpload) -> None:
        caps = self._archive_caps
        if len(upload.data) > caps.bytes:
            raise ArchiveTooLargeError(
                f"the archive is {len(upload.data)} bytes, over caps.archive.bytes = {caps.bytes}"
            )

    async def _load_archive(self, upload: ArchiveUpload, dest: Path, staging: Path) -> Environment:
        """Unpack and load an upload into `dest` (the upload's bytes are written under `staging` first)."""
        kind = self._kind(upload.kind)
        archive = staging / "upload"
        # both to their end if the caller goes (its deadline, a cancel): a thread goes on writing, and the caller's
        # removal of `staging` ran under it and left what it wrote after (and freed the tenant's slot meanwhile)
        await to_the_end(asyncio.ensure_future(asyncio.to_thread(archive.write_bytes, upload.data)))
        limits = self._archive_caps.limits()
        env = await to_the_end(
            asyncio.ensure_future(asyncio.to_thread(kind.load, archive, dest, upload.name, upload.version, limits))
        )
        if not isinstance(env, BuildsOwnImage) or env.ref() != upload.ref():
            raise InvalidEnvironmentError(f"the {upload.kind} kind made no environment {upload.ref()} that builds")
        check_limits(env.limits, self._caps, "the tasks' limits")
        return env

    async def _check_archive(self, env: Environment, upload: ArchiveUpload, tenant: str) -> ValidationResult:
        """Build the image and run every task's check; SpecCheckError lists each task's problems."""
        async with self._check_time("archive"):
            return await self._check_archive_steps(env, upload, tenant)

    async def _check_archive_steps(self, env: Environment, upload: ArchiveUpload, tenant: str) -> ValidationResult:
        assert isinstance(env, BuildsOwnImage)
        kind = self._kind(upload.kind)
        result = ValidationResult(env=upload.ref(), image="", num_tasks=len(env.tasks()))
        result.checks.append(
            f"archive: kind {upload.kind}, {len(upload.data)} bytes (sha256 {upload.digest[:12]}), "
            f"{result.num_tasks} task(s), tools {', '.join(tool_names(env.tools))}"
        )
        try:
            result.image = await self._built(env, tenant)
        except ImageBuildError as e:
            raise SpecCheckError([Problem("image", f"the image does not build: {e}")]) from None
        result.checks.append(f"image: {result.image}")
        result.tasks = list(await kind.validate(env, self._backend, result.image))
        problems = [Problem(f"task {t.task_id}", p) for t in result.tasks for p in t.problems]
        if problems:
            raise SpecCheckError(problems)
        for t in result.tasks:
            result.checks.append(
                f"task {t.task_id}: reference {_reward(t.reference_reward)}, empty {_reward(t.empty_reward)}"
            )
        first = result.tasks[0] if result.tasks else None
        if first is not None:
            result.reference_task_id, result.reference_reward = first.task_id, first.reference_reward
        return result

    async def validate_archive(self, upload: ArchiveUpload, tenant: str = LOCAL_TENANT) -> ValidationResult:
        """Unpack, load, build and check an uploaded archive; registers nothing."""
        started = time.monotonic()
        self._kind(upload.kind)
        self._check_size(upload)
        async with self._checks.slot(tenant):
            staging = await asyncio.to_thread(self._archives.staging, tenant)
            try:
                env = await self._load_archive(upload, staging / "tree", staging)
                result = await self._check_archive(env, upload, tenant)
            finally:
                await asyncio.to_thread(shutil.rmtree, staging, True)
        result.duration_s = time.monotonic() - started
        return result

    def _same_archive(self, upload: ArchiveUpload) -> Callable[[Registered], bool]:
        def same(r: Registered) -> bool:
            shipped = self.catalog.shipment(r.env)
            public = upload.visibility == "public"
            return shipped is not None and shipped.digest == upload.digest and (r.owner is None) == public

        return same

    async def register_archive(self, upload: ArchiveUpload, tenant: str) -> Registered:
        """Validate, persist (archive and record under the tenant's folder), add to the registry; all or nothing."""
        rules = self._kind(upload.kind).rules
        self._check_size(upload)
        async with self._name_lock(upload.name):
            existing = self._claim(upload.name, upload.version, tenant, self._same_archive(upload))
            if existing is not None:
                shipped = self.catalog.shipment(existing.env)
                if shipped is not None and shipped.rules != rules:
                    # the same archive again is a no-op, but this one runs unvalidated (_add_archive): said, not
                    # passed off as the registration it asked for
                    raise FailedPreconditionError(
                        f"{upload.ref()} was validated under older {upload.kind} rules ({shipped.rules!r}, not "
                        f"{rules!r}) and runs as not validated; register it under a new version to validate it again"
                    )
                return existing
            record = StoredArchive(
                owner=tenant,
                registered_at=time.time(),
                kind=upload.kind,
                name=upload.name,
                version=upload.version,
                visibility=upload.visibility,
                digest=upload.digest,
                size=len(upload.data),
                rules=rules,
            )
            async with self._checks.slot(tenant):  # a tenant's checks are serialized: so is the growth of its store
                self._kept.check(tenant)
                await self._check_held(tenant, len(upload.data), "more")
                staging = await asyncio.to_thread(self._archives.staging, tenant)
                dest = await asyncio.to_thread(self._archives.tree, tenant, upload.ref())
                try:
                    env = await self._load_archive(upload, dest, staging)
                    await self._check_held(tenant, len(upload.data), "more, with its unpacked tree,")
                    await self._check_archive(env, upload, tenant)
                    await asyncio.to_thread(self._archives.save, record, upload.data)
                    self._add_archive(env, record, self._archives.archive_path(record))
                except BaseException:
                    await asyncio.to_thread(self._archives.delete, record)
                    raise
                finally:
                    await asyncio.to_thread(shutil.rmtree, staging, True)
            log.info("tenant %s registered %s from a %s archive", tenant, upload.ref(), upload.kind)
            return self._registry.lookup(upload.ref())

    async def _check_held(self, tenant: str, adding: int, what: str) -> None:
        """Refuse an archive of `adding` bytes that would take the tenant's store over its cap."""
        held = await asyncio.to_thread(self._archives.held_bytes, tenant)
        cap = self._archive_caps.bytes_per_tenant
        if held + adding > cap:
            raise ArchiveTooLargeError(
                f"tenant {tenant} keeps {held} bytes of registered archives and their unpacked trees; {adding} "
                f"{what} would be over caps.archive.bytes_per_tenant = {cap}"
            )

    def _add_archive(self, env: Environment, record: StoredArchive, path: Path) -> None:
        kind = self._kind(record.kind)
        # it passed its checks when it was registered, under the rules then in force: under other ones (an upgrade
        # changed how its tasks run), what they proved is not known, and a failure is the environment's, not a 0
        if record.rules == kind.rules:
            env = kind.validated(env)
        else:
            log.warning(
                "%s (tenant %s) was validated under %s archive rules %r, not this version's %r: it runs as not "
                "validated (a grader failure is ENV_ERROR, never a 0) until it is registered again under a new version",
                record.ref(),
                record.owner,
                record.kind,
                record.rules,
                kind.rules,
            )
        owner = None if record.visibility == "public" else record.owner
        self._registry.register(env, source=ARCHIVE_SOURCE + record.kind, owner=owner)
        self.catalog.add(env, Shipment(record.kind, record.name, record.version, record.digest, path, record.rules))
        self._owners.setdefault(record.name, record.owner)
        self._kept.add(record.owner, 1)
