"""`envfleet swe-build`: a SWE-bench-format dataset from pinned PyPI sdists, SWE-smith style, fully offline after
the sdists are fetched.

Per project: fetch and check the sdist -> build its image (the pristine repository) -> run its test suite in a
sandbox to find the passing tests -> inject bugs into functions (builder.mutate) -> run, per mutant, the test files
that mention the mutated function (many mutants per sandbox, one exec) -> FAIL_TO_PASS = tests the mutant breaks,
PASS_TO_PASS = every one it leaves passing, gold patch = the reverse diff, problem statement from
the failures -> validate every instance through the evaluation harness (gold resolves, empty does not).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import re
import secrets
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import docker

from environments.swe.builder.mutate import Mutant, mutants_of, pick
from environments.swe.builder.pins import ProjectPin
from environments.swe.builder.problem import problem_statement
from environments.swe.evaluate import INFRA_ATTEMPTS, SWE_LIMITS, ImageCache
from environments.swe.grading import PARSERS, StatusMap, TestStatus, unittest_id
from environments.swe.images import fetch_source, repo_image, swe_cache
from environments.swe.instance import EnvironmentSpec, SweInstance, TestRunner
from environments.swe.patches import file_diff
from environments.swe.script import BOOTSTRAP, EVAL_ENV, SCRATCH, UNITTEST_RUNNER, Bundle
from environments.swe.snapshot import extract_archive, snapshot_commit
from environments.swe.validate import validate_dataset
from orchestrator.core.errors import EnvfleetError, SandboxError
from orchestrator.core.sandbox import SandboxBackend, SandboxSpec
from orchestrator.images.cache import file_lock

log = logging.getLogger(__name__)

SEED = 20261129
MAX_RUN_OUTPUT = 400_000


class BuildError(EnvfleetError, RuntimeError):
    """A project could not be turned into instances (its suite does not run, nothing passes...)."""


@dataclass(frozen=True)
class BuildOptions:
    """How many instances, how mutants are tried, and how they are validated."""

    seed: int = SEED
    tries_per_instance: float = 3.0
    max_fail_to_pass: int = 8
    # None: every test of the files run that passed before the bug and still passes with it, as SWE-bench lists
    # them (a sample of 10 let a patch that special-cased the failing inputs and broke the rest of a file resolve)
    max_pass_to_pass: int | None = None
    max_failing: int = 40  # a mutant that breaks more tests than this is too blunt to be a task
    batch: int = 12  # mutants per sandbox
    workers: int = 2
    validate_runs: int = 1
    test_timeout_s: float = 120.0
    instances_per_project: int | None = None  # overrides each pin's count (a small build for CI)


@dataclass
class ProjectStats:
    """What happened to one project's mutants."""

    package: str
    tried: int = 0
    killed: int = 0
    shipped: int = 0
    passing_tests: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def reject(self, reason: str) -> None:
        """Count a rejected mutant."""
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


@dataclass(frozen=True)
class _Candidate:
    mutant: Mutant
    targets: tuple[str, ...]


@dataclass(frozen=True)
class _Project:
    pin: ProjectPin
    tree: Path
    image: str
    env_commit: str
    test_files: dict[str, str]  # target (path or module) -> source text


def _target_of(pin: ProjectPin, test: str) -> str:
    """The test file (pytest) or module (unittest) a test belongs to."""
    if pin.framework == "pytest":
        return test.split("::", 1)[0]
    return unittest_id(test).rsplit(".", 2)[0]


def _run_command(pin: ProjectPin, targets: Sequence[str]) -> list[str]:
    if pin.framework == "pytest":
        return ["python3", "-m", "pytest", "-rA", "--tb=short", "-p", "no:cacheprovider", "--confcutdir=.", *targets]
    return ["python3", f"{SCRATCH}/unittest_runner.py", *(unittest_id(t) if " (" in t else t for t in targets)]


def _batch_script(pin: ProjectPin, runs: Sequence[tuple[str, Sequence[str]]], nonce: str, timeout_s: float) -> str:
    """Run each (patch file, targets) on a fresh tree; fence each output with the nonce."""
    pythonpath = ":".join(f"/workspace/{p}" for p in pin.pythonpath)
    lines = [
        "#!/bin/bash",
        "set -uo pipefail",
        "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in EVAL_ENV.items()),
        "find /workspace -mindepth 1 -delete && cp -a /opt/repo/. /workspace/ && cd /workspace || exit 3",
        f"export PYTHONPATH={shlex.quote(pythonpath)}" if pythonpath else "unset PYTHONPATH",
    ]
    for i, (patch, targets) in enumerate(runs):
        lines += [
            'git reset -q --hard HEAD && git clean -fdq || { echo "reset failed"; exit 3; }',
            f'if [ -s {SCRATCH}/{patch} ] && ! git apply {SCRATCH}/{patch}; then echo "@@@ {nonce} {i} NOAPPLY";'
            f" else timeout -k 5 {timeout_s:g} {shlex.join(_run_command(pin, targets))}"
            f" > {SCRATCH}/out 2>&1 < /dev/null; rc=$?; echo '@@@ {nonce} {i} START';"
            f' head -c {MAX_RUN_OUTPUT} {SCRATCH}/out; echo; echo "@@@ {nonce} {i} END $rc"; fi',
        ]
    return "\n".join(lines) + "\n"


def _split_runs(text: str, nonce: str, count: int) -> list[tuple[str, int | None]]:
    """Each run's output and exit code (None: the patch did not apply or the run is missing)."""
    out: list[tuple[str, int | None]] = []
    for i in range(count):
        m = re.search(rf"^@@@ {nonce} {i} START\n(.*?)\n@@@ {nonce} {i} END (-?\d+)$", text, re.S | re.M)
        out.append((m.group(1), int(m.group(2))) if m else ("", None))
    return out


class DatasetBuilder:
    """Builds instances for pinned projects on a sandbox backend."""

    def __init__(
        self,
        backend: SandboxBackend,
        client: docker.DockerClient,
        options: BuildOptions = BuildOptions(),
        *,
        cache_dir: Path | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.backend = backend
        self.client = client
        self.options = options
        self.cache_dir = cache_dir
        self.images = ImageCache(client, cache_dir=cache_dir)
        self._progress = progress or (lambda msg: log.info("%s", msg))
        self._sandboxes = asyncio.Semaphore(options.workers)

    async def _exec_batch(
        self, image: str, pin: ProjectPin, runs: Sequence[tuple[str, Sequence[str]]], patches: dict[str, str]
    ) -> list[tuple[str, int | None]]:
        nonce = secrets.token_hex(6)
        script = _batch_script(pin, runs, nonce, self.options.test_timeout_s)
        files = {"eval.sh": script.encode(), "unittest_runner.py": UNITTEST_RUNNER.encode()}
        files.update({name: text.encode() for name, text in patches.items()})
        budget = (self.options.test_timeout_s + 30) * len(runs) + 60
        async with self._sandboxes:
            for attempt in range(1, INFRA_ATTEMPTS + 1):
                sb = None
                try:
                    sb = await self.backend.create(SandboxSpec(image=image, limits=SWE_LIMITS, env=EVAL_ENV))
                    r = await sb.exec(
                        ["bash", "-c", f"exec 2>&1; {BOOTSTRAP}"],
                        stdin=Bundle(files).tar(),
                        timeout=budget,
                        max_output=(MAX_RUN_OUTPUT + 4096) * len(runs) + (1 << 20),
                    )
                    break
                except SandboxError as e:
                    if attempt == INFRA_ATTEMPTS:
                        raise
                    log.warning("%s: sandbox failure (attempt %d), retrying: %s", pin.package, attempt, e)
                finally:
                    if sb is not None:
                        await sb.release()
        return _split_runs(r.stdout.decode(errors="replace"), nonce, len(runs))

    async def _prepare(self, pin: ProjectPin) -> _Project:
        source = pin.source()
        archive = await asyncio.to_thread(fetch_source, source, self.cache_dir)
        tree = swe_cache(self.cache_dir) / "src" / pin.sha256[:16]
        await asyncio.to_thread(_unpack, archive, tree, source.strip_components, swe_cache(self.cache_dir) / "locks")
        env_commit = snapshot_commit(tree)
        env_image = await self.images.environment(EnvironmentSpec())
        image = await asyncio.to_thread(
            repo_image,
            self.client,
            name=f"swe/project-{re.sub(r'[^a-z0-9]+', '-', pin.package.lower())}",
            source=source,
            base_commit=env_commit,
            env_image=env_image,
            labels={"envfleet.swe.tier": "project", "envfleet.swe.project": f"{pin.package}=={pin.version}"},
            cache_dir=self.cache_dir,
        )
        return _Project(pin, tree, image, env_commit, self._test_files(pin, tree))

    @staticmethod
    def _test_files(pin: ProjectPin, tree: Path) -> dict[str, str]:
        files: dict[str, str] = {}
        for target in pin.test_targets:
            if pin.framework == "unittest":
                roots = pin.pythonpath or ["."]
                for r in roots:
                    path = tree / r / (target.replace(".", "/") + ".py")
                    if path.is_file():
                        files[target] = path.read_text(errors="replace")
                continue
            base = tree / target
            paths = [base] if base.is_file() else sorted(base.rglob("test_*.py"))
            for p in paths:
                rel = p.relative_to(tree).as_posix()
                if not any(x in rel for x in pin.exclude_tests):
                    files[rel] = p.read_text(errors="replace")
        if not files:
            raise BuildError(f"{pin.package}: no test files under {pin.test_targets}")
        return files

    def _candidates(self, project: _Project, count: int, rng: random.Random) -> list[_Candidate]:
        pin, tree = project.pin, project.tree
        found: list[Mutant] = []
        for src in pin.source_dirs:
            base = tree / src
            for path in [base] if base.is_file() else sorted(base.rglob("*.py")):
                rel = path.relative_to(tree).as_posix()
                if "/tests/" in f"/{rel}" or path.name.startswith(("test_", "conftest")):
                    continue
                found.extend(mutants_of(rel, path.read_text(errors="replace")))
        chosen: list[_Candidate] = []
        by_name: dict[str, tuple[str, ...]] = {}
        usable = []
        for m in found:
            name = m.function.rsplit(".", 1)[-1]
            if name not in by_name:
                word = re.compile(rf"\b{re.escape(name)}\b")
                by_name[name] = tuple(t for t, text in project.test_files.items() if word.search(text))
            if by_name[name] and not name.startswith("__"):
                usable.append(m)
        for m in pick(usable, count, rng):
            chosen.append(_Candidate(m, by_name[m.function.rsplit(".", 1)[-1]]))
        return chosen

    def _usable(self, pin: ProjectPin, name: str) -> bool:
        """Not excluded, and a name both runners and SWE-bench's parsers read the same way."""
        if any(x in name for x in pin.exclude_tests):
            return False
        if pin.framework == "unittest":
            return re.fullmatch(r"\w+ \([\w.]+\)", name) is not None
        return not any(c.isspace() for c in name)

    async def build_project(self, pin: ProjectPin) -> tuple[list[SweInstance], ProjectStats]:
        """Instances (not yet validated through the harness) for one project, in a stable order."""
        started = time.monotonic()
        stats = ProjectStats(pin.package)
        self._progress(f"{pin.package} {pin.version}: fetching and building the project image")
        project = await self._prepare(pin)
        parse = PARSERS[pin.framework]
        ((baseline_out, code),) = await self._exec_batch(project.image, pin, [("none.patch", pin.test_targets)], {})
        baseline = parse(baseline_out)
        passing = {t for t, s in baseline.items() if s == TestStatus.PASSED and self._usable(pin, t)}
        stats.passing_tests = len(passing)
        self._progress(f"{pin.package}: {len(passing)} passing tests (suite exit code {code})")
        if not passing:
            raise BuildError(f"{pin.package}: no test passes on the pristine tree; output:\n{baseline_out[-2000:]}")
        ordered = sorted(passing)
        wanted = self.options.instances_per_project or pin.instances
        rng = random.Random(f"{self.options.seed}:{pin.package}:{pin.version}")
        candidates = self._candidates(project, math.ceil(wanted * self.options.tries_per_instance), rng)
        stats.tried = len(candidates)
        self._progress(f"{pin.package}: trying {len(candidates)} mutants")
        batches = [candidates[i : i + self.options.batch] for i in range(0, len(candidates), self.options.batch)]

        async def run(batch: list[_Candidate]) -> list[tuple[str, int | None]]:
            patches = {
                f"m{i}.patch": file_diff(c.mutant.path, c.mutant.original, c.mutant.mutated)
                for i, c in enumerate(batch)
            }
            # only the tests that passed on the pristine tree, in the files that mention the function: excluded
            # (slow, flaky) tests never run
            runs = [
                (f"m{i}.patch", [t for t in ordered if _target_of(pin, t) in c.targets]) for i, c in enumerate(batch)
            ]
            return await self._exec_batch(project.image, pin, runs, patches)

        results = await asyncio.gather(*(run(b) for b in batches))
        instances: list[SweInstance] = []
        for batch, outs in zip(batches, results, strict=True):
            for cand, (out, rc) in zip(batch, outs, strict=True):
                inst = self._instance(project, cand, out, rc, parse, passing, stats)
                if inst is not None:
                    instances.append(inst)
        stats.seconds = time.monotonic() - started
        return instances, stats

    def _instance(
        self,
        project: _Project,
        cand: _Candidate,
        out: str,
        rc: int | None,
        parse: Callable[[str], StatusMap],
        passing: set[str],
        stats: ProjectStats,
    ) -> SweInstance | None:
        pin, m = project.pin, cand.mutant
        if rc is None:
            stats.reject("did not apply or did not run")
            return None
        statuses = parse(out)
        ran = [t for t in statuses if t in passing]
        failing = sorted(t for t in ran if statuses[t] in (TestStatus.FAILED, TestStatus.ERROR))
        still = sorted(t for t in ran if statuses[t] == TestStatus.PASSED)
        if rc in (124, 137):
            stats.reject("timed out")
            return None
        if not failing:
            stats.reject("no test fails (survived)")
            return None
        stats.killed += 1
        if len(failing) > self.options.max_failing:
            stats.reject("too many tests fail")
            return None
        if not still:
            stats.reject("no PASS_TO_PASS test")
            return None
        # seeded by the mutant alone: a smaller build samples the same tests for the same mutant
        local = random.Random(f"{self.options.seed}:{m.key}")
        f2p = (
            failing
            if len(failing) <= self.options.max_fail_to_pass
            else sorted(local.sample(failing, self.options.max_fail_to_pass))
        )
        cap = self.options.max_pass_to_pass
        p2p = still if cap is None or len(still) <= cap else sorted(local.sample(still, cap))
        setup = file_diff(m.path, m.original, m.mutated)
        gold = file_diff(m.path, m.mutated, m.original)
        base = snapshot_commit(project.tree, {m.path: m.mutated.encode()})
        digest = hashlib.sha256(setup.encode()).hexdigest()[:8]
        return SweInstance(
            instance_id=f"pypi__{pin.package}-{pin.version}-{digest}",
            repo=pin.repo,
            base_commit=base,
            problem_statement=problem_statement(pin.package, f2p, out, pin.framework),
            patch=gold,
            test_patch="",
            FAIL_TO_PASS=f2p,
            PASS_TO_PASS=p2p,
            version=pin.version,
            environment_setup_commit=project.env_commit,
            source=pin.source().model_copy(update={"setup_patch": setup}),
            test_runner=TestRunner(
                framework=pin.framework, pythonpath=list(pin.pythonpath), timeout_s=self.options.test_timeout_s
            ),
        )


async def build_dataset(
    pins: Sequence[ProjectPin],
    *,
    backend: SandboxBackend,
    client: docker.DockerClient,
    options: BuildOptions = BuildOptions(),
    log_dir: Path,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[SweInstance], list[ProjectStats]]:
    """Build, validate through the harness, and trim to each pin's count: the shipped instances and the stats."""
    builder = DatasetBuilder(backend, client, options, cache_dir=cache_dir, progress=progress)
    say = builder._progress
    results = await asyncio.gather(*(builder.build_project(pin) for pin in pins), return_exceptions=True)
    built: list[tuple[list[SweInstance], ProjectStats]] = []
    for pin, res in zip(pins, results, strict=True):
        if isinstance(res, BuildError):
            say(f"{pin.package}: left out: {res}")
            built.append(([], ProjectStats(pin.package, reasons={f"project failed: {str(res)[:200]}": 1})))
        elif isinstance(res, BaseException):
            raise res
        else:
            built.append(res)
    # validate a few more than needed, in the builder's order, to replace any that fail
    candidates = [
        inst
        for pin, (insts, _) in zip(pins, built, strict=True)
        for inst in insts[: math.ceil((options.instances_per_project or pin.instances) * 1.25) + 1]
    ]
    stats = [s for _, s in built]
    say(f"validating {len(candidates)} candidate instances through the harness ({options.validate_runs} gold run(s))")
    result = await validate_dataset(
        candidates,
        backend=backend,
        client=client,
        runs=options.validate_runs,
        workers=options.workers,
        log_dir=log_dir,
        run_id="build-validate",
        cache_dir=cache_dir,
    )
    valid = {i.instance_id: i for i in result.instances if not i.quarantined_tests}
    shipped: list[SweInstance] = []
    for pin, (insts, st) in zip(pins, built, strict=True):
        wanted = options.instances_per_project or pin.instances
        keep = [valid[i.instance_id] for i in insts if i.instance_id in valid][:wanted]
        st.shipped = len(keep)
        tried = {c.instance_id for c in candidates}
        rejected = len([i for i in insts if i.instance_id in tried and i.instance_id not in valid])
        if rejected:
            st.reasons["failed harness validation"] = rejected
        shipped.extend(keep)
    return sorted(shipped, key=lambda i: i.instance_id), stats


def _unpack(archive: Path, tree: Path, strip_components: int, locks: Path) -> None:
    """The project's source at `tree`, unpacked once; under a lock shared with other processes on this cache (two
    `swe-build`s of one pin: one removed the tree the other was renaming into, or taking its snapshot of)."""
    done = tree.with_name(tree.name + ".complete")  # outside the tree: it is no part of the snapshot
    with file_lock(locks, f"src-{tree.name}"):
        if done.is_file():
            return
        tree.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tree, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=tree.parent) as tmp:
            staging = Path(tmp) / "tree"
            extract_archive(archive, staging, strip_components)
            staging.rename(tree)
        done.write_text("")
