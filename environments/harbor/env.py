"""HarborEnvironment: Harbor task directories as one envfleet environment.

The image is the tasks' environment/Dockerfile (their build context: environment/), built offline under the tenant
build limits, plus a tail that makes Harbor's writable paths work on a read-only root:

- the task's workdir (the Dockerfile's last WORKDIR, else /app) becomes a symlink to /workspace (the sandbox's
  writable tmpfs); what the image had there is moved to /opt/harbor/seed, which setup copies into /workspace (also
  the reset seed);
- /tests, /solution and /logs become symlinks into /tmp/harbor/ (the writable /tmp tmpfs), made by setup.

The whole Dockerfile (the task's text and the tail) is checked as the tenant's Dockerfiles are, right before it is
built; a task's last instruction may not continue into the tail.

The agent's tools run in /workspace (= the workdir); after the episode tests/ is uploaded to /tests and
`/tests/test.sh` runs (by its `#!` line) from the workdir with [verifier] env and timeout, under the clean grader's
environment (GRADER_ENV: no user site, an empty HOME); the reward is read by Harbor's rules.
"""

from __future__ import annotations

import json
import logging
import secrets
import shlex
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import docker

from environments.harbor.task import (
    HarborRewardError,
    HarborRunError,
    HarborTask,
    HarborTaskError,
    load_task,
    parse_reward,
)
from orchestrator.core.environment import GRADER_ENV, Environment, Episode, Rubric, Score, Task
from orchestrator.core.errors import SandboxError, SandboxFileError, SandboxFileNotFoundError
from orchestrator.core.sandbox import PROBE_TIMEOUT_S, ExecResult, Limits, Sandbox, keeps_time
from orchestrator.images import build_image
from orchestrator.images.build import BuildLimits, ContextFile, Executable
from orchestrator.images.resolver import BuildsOwnImage
from orchestrator.service.declarative import dockerfile as dockerfile_check
from orchestrator.service.registry import MAX_TOOL_TIMEOUT_S

log = logging.getLogger(__name__)

SEED = "/opt/harbor/seed"
RUNTIME = "/tmp/harbor"  # inside the sandbox: its own /tmp tmpfs
VERIFIER_DIR = f"{RUNTIME}/logs/verifier"  # /logs/verifier; envd's file calls do not follow links
MAX_OUTPUT = 1 << 20
# what the grader writes on /tmp besides tests/ (logs, reward, a HOME's first caches): less room than this left by
# the agent is a full /tmp, its own outcome
GRADER_SLACK_KIB = 1024
GRADER_SLACK_INODES = 64
TMP_FULL_METRIC = "agent_filled_tmp"
VERIFIER_FAILED_METRIC = "verifier_failed_after_agent"
VERIFIER_RERUN_METRIC = "verifier_ran_again_after_timeout"
TMP_CHECK_S = 30.0  # df on /tmp, when the verifier could not run
TAIL_CHARS = 600
ENVD_CMD = '["python3", "-S", "-OO", "/opt/envfleet/envd/launch.py"]'
SYSTEM_PROMPT = (
    "You are an agent working in a Linux sandbox without network access. Use the tools to complete the task; "
    "call submit when done."
)
# a task that sets no limits: Harbor's 2 GiB and 1 CPU; a process cap Harbor does not have (a fork bomb stays in its
# sandbox); /tmp and the workspace are tmpfs within the memory (Harbor's are on the container's disk), at 256 MiB
# and 1 GiB the most that fits beside a quarter kept for the processes
DEFAULT_LIMITS = Limits(memory_mb=2048, cpus=1.0, pids=1024, tmp_mb=256)


class VerifierTimeoutError(HarborRewardError):
    """test.sh ran past its timeout, so it wrote no reward."""


def _tail(r: ExecResult) -> str:
    text = (r.stdout + b"\n" + r.stderr).decode(errors="replace").strip()
    return text if len(text) <= TAIL_CHARS else "..." + text[-TAIL_CHARS:]


ORACLE_ENV = {"DEBIAN_FRONTEND": "noninteractive"}


def _in(workdir: str, cmd: str) -> list[str]:
    """Run `cmd` from the task's workdir as Harbor does (a cd, so `pwd` shows the workdir, not /workspace). A script
    runs by its own `#!` line, as Harbor's (a `#!/usr/bin/env python3` test.sh ran as bash here); one without runs
    under bash, which execs it so."""
    return ["/bin/bash", "-c", f"cd {shlex.quote(workdir)} && exec {cmd}"]


# The grader's own commands (rm, mkdir, find, df, bash) are the image's, found on a PATH of read-only folders: the
# image's or a task's PATH may name one under the workdir (uv's /app/.venv/bin), which is the agent's /workspace, and
# a `bash` the agent left there ran in place of the grader's and wrote the reward. test.sh keeps the task's PATH:
# what it runs from there is the agent's, as the code under test is (README, "Harbor tasks").
GRADER_PATH = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


def image_tail(task: HarborTask) -> str:
    """The lines appended to a task's Dockerfile: writable workdir, Harbor's paths, environment, envd."""
    w = shlex.quote(task.workdir)
    steps = ["set -e", f"mkdir -p {SEED}"]
    if task.workdir == "/workspace":
        steps.append(f"if [ -d /workspace ]; then cp -a /workspace/. {SEED}/; fi")
    else:
        steps += [
            f"if [ -d {w} ] && [ ! -L {w} ]; then cp -a {w}/. {SEED}/ && rm -rf {w}; fi",
            f'mkdir -p "$(dirname {w})"',
            f"ln -sfn /workspace {w}",
        ]
    steps += [
        "rm -rf /tests /solution /logs",
        f"ln -s {RUNTIME}/tests /tests",
        f"ln -s {RUNTIME}/solution /solution",
        f"ln -s {RUNTIME}/logs /logs",
    ]
    lines = ["", "# envfleet: Harbor paths on a read-only root", "USER root", "RUN " + " && ".join(steps)]
    lines += [f'ENV {k}="{v}"' for k, v in sorted(task.env.items())]
    lines += ["WORKDIR /workspace", f"CMD {ENVD_CMD}", ""]
    return "\n".join(lines)


def built_dockerfile(task: HarborTask) -> str:
    """The Dockerfile built for a task's environment, its own (or FROM its docker_image) plus the tail, checked
    whole: the text checked is the text built. A HarborTaskError names the task and the problem."""
    where = "environment/Dockerfile" if task.dockerfile is not None else "[environment] docker_image"
    head = task.dockerfile if task.dockerfile is not None else f"FROM {task.docker_image}\n"
    tail = image_tail(task)
    text = head.rstrip("\n") + "\n" + tail
    try:
        # a last line that continues (ends in the escape character) runs on into the tail: blank lines and comments
        # do not end it, so nothing appended can; the tail must come out as its own instructions
        ours = [(i.keyword, i.args) for i in dockerfile_check.parse(tail)]
        built = dockerfile_check.parse(text)
        start = max(len(built) - len(ours), 0)
        if [(i.keyword, i.args) for i in built[start:]] != ours:
            raise HarborTaskError(
                f"task {task.id}: {where}: the lines envfleet appends would join its last instruction (line "
                f"{built[start].line}), which continues past the end of the file; remove the escape character at "
                "its end"
            )
        dockerfile_check.check(text)
    except dockerfile_check.DockerfileError as e:
        raise HarborTaskError(f"task {task.id}: {where}: {e}") from None
    return text


def image_name(env_name: str) -> str:
    """The image repository of an imported environment: under envfleet/env-, like every registered environment's,
    so no tenant's Dockerfile may build FROM it (orchestrator/service/declarative/dockerfile.py)."""
    return "env-harbor-" + "-".join(p for p in env_name.replace("_", "-").replace(".", "-").split("-") if p)


class HarborEnvironment(Environment, BuildsOwnImage):
    """Base of the classes `make_harbor_environment` creates (an Environment's identity is class-level)."""

    task_dirs: ClassVar[tuple[Path, ...]] = ()
    # every task's oracle scored above 0 and its empty solution below it, on this image (validate.py): each test.sh
    # is known to write a reward, in time, in a sandbox of this environment, whether the task is solved or not
    validated: ClassVar[bool] = False
    tools = ("bash", "read_file", "write_file", "str_replace", "submit")
    system_prompt = SYSTEM_PROMPT
    rubric = Rubric([])  # unused: score() runs the task's test.sh
    workspace_seed = SEED
    max_turns = 64

    @cached_property
    def harbor_tasks(self) -> dict[str, HarborTask]:
        """The parsed task directories by id."""
        return load_tasks(self.task_dirs)

    def tasks(self) -> Sequence[Task]:
        """One Task per directory; the prompt is instruction.md."""
        return [Task(id=t.id, prompt=t.instruction) for t in self.harbor_tasks.values()]

    def image_description(self) -> str:
        """How Describe shows the image."""
        return "built from the Harbor tasks' environment/Dockerfile"

    def _first(self) -> HarborTask:
        return next(iter(self.harbor_tasks.values()))

    def dockerfile(self) -> str:
        """The Dockerfile built: the tasks' own (or FROM their docker_image) plus the Harbor tail, checked whole."""
        return built_dockerfile(self._first())

    def build_image(self, client: docker.DockerClient) -> str:
        """Build (or find cached) the image offline under tenant limits; returns its tag. Blocking: use a thread."""
        t = self._first()
        context: Mapping[str, ContextFile] = {
            k: Executable(v) if f"environment/{k}" in t.executables else v
            for k, v in t.context.items()
            if k != "Dockerfile"
        }
        limits = BuildLimits(timeout_s=max(x.build_timeout_s for x in self.harbor_tasks.values()))
        text = self.dockerfile()
        return build_image(
            client,
            name=image_name(self.name),
            dockerfile=text,
            context_files=context,
            limits=limits,
            from_images=dockerfile_check.check(text),  # each on this host: a build never pulls
            adds=dockerfile_check.adds(text),
        )

    async def _sh(self, sandbox: Sandbox, cmd: str, timeout: float, what: str) -> ExecResult:
        # from /: envd's default, the workspace, is the agent's to `chmod 000`, and every step of the grader's then
        # failed (exit 126), an ENV_ERROR the agent chose over its 0
        r = await sandbox.exec(["/bin/sh", "-c", cmd], cwd="/", env=GRADER_PATH, timeout=timeout, max_output=MAX_OUTPUT)
        if not r.ok:
            raise HarborRunError(f"{what} failed (exit {r.exit_code}): {_tail(r)}")
        return r

    async def setup(self, sandbox: Sandbox, task: Task, seed: int) -> None:
        """Make Harbor's writable paths and copy the image's workdir content into the workspace."""
        await self._sh(
            sandbox,
            f"if [ ! -d {SEED} ]; then echo 'not the image built from the Harbor Dockerfile (no {SEED}): "
            "serve the environment from an orchestrator' >&2; exit 1; fi; "
            f"mkdir -p {RUNTIME}/tests {RUNTIME}/solution {RUNTIME}/logs/verifier {RUNTIME}/logs/agent "
            f"&& cp -a {SEED}/. /workspace/",
            self.tool_timeout_s,
            "preparing the workdir",
        )

    async def _upload(self, sandbox: Sandbox, t: HarborTask, what: str) -> None:
        """Upload the task's folder `what` (tests, solution) to its runtime path; a file keeps its executable bit,
        and every `.sh` is executable (as before the bit was kept)."""
        dest = f"{RUNTIME}/{what}"
        await self._sh(sandbox, f"rm -rf {dest} && mkdir -p {dest}", self.tool_timeout_s, f"clearing {dest}")
        files: Mapping[str, bytes] = t.tests if what == "tests" else t.solution
        for rel, data in files.items():
            executable = rel.endswith(".sh") or f"{what}/{rel}" in t.executables
            await sandbox.write_file(f"{dest}/{rel}", data, mode=0o755 if executable else 0o644)

    async def run_solution(self, sandbox: Sandbox, task_id: str, *, empty: bool = False) -> ExecResult | None:
        """Upload solution/ and run `/solution/solve.sh` (by its `#!` line) from the workdir (the oracle); `empty`:
        nothing."""
        t = self.harbor_tasks[task_id]
        if empty:
            return None
        await self._upload(sandbox, t, "solution")
        return await sandbox.exec(
            _in(t.workdir, "/solution/solve.sh"),
            env={**ORACLE_ENV, **t.solution_env},  # as Harbor's oracle agent runs it
            timeout=t.agent_timeout_s,
            max_output=MAX_OUTPUT,
        )

    async def _verifier_home(self, sandbox: Sandbox, verifier_env: Mapping[str, str]) -> str:
        """The verifier's HOME: the task's or the image's when the agent never controlled it (on the read-only
        root, not writable, nor anything in it: its tools, a toolchain under ~/.rustup say, are as the image made
        them), else a fresh empty one of the grader's, under a name the agent could not guess. A HOME the agent
        controlled is the agent's: what it left there would run in the verifier, and /nonexistent broke every
        test.sh whose tools keep a cache in HOME (uv, go, npm, cargo), a right solution scored 0.

        Judged by where it really is, not by whether it is writable now: the agent owns /workspace (and a folder it
        made under /tmp), so it could leave a ~/.gitconfig in HOME=/app, the workdir's link to /workspace, and
        then `chmod 555 /workspace`: not writable any more, that HOME was the verifier's."""
        fresh = f"{RUNTIME}/home-{secrets.token_hex(8)}"
        agents = (
            'h="${HOME:-/}"; r=$(readlink -f -- "$h" 2>/dev/null) || r="$h"; '
            'case "$r/" in /workspace/*|/tmp/*|/dev/*|/var/tmp/*|/run/*) true ;; '
            '*) [ -w "$h" ] || find -L "$h" -maxdepth 1 -name ".?*" -writable | grep -q . ;; esac'
        )
        pick = f'if {agents}; then mkdir -m 0700 {fresh} && echo {fresh}; else echo "$h"; fi'
        r = await sandbox.exec(
            ["/bin/sh", "-c", pick],
            cwd="/",
            env={**verifier_env, **GRADER_PATH},
            timeout=self.tool_timeout_s,
            max_output=MAX_OUTPUT,
        )
        if not r.ok:
            raise HarborRunError(f"making the verifier's HOME failed (exit {r.exit_code}): {_tail(r)}")
        return r.stdout.decode(errors="replace").strip()

    async def _read(self, sandbox: Sandbox, path: str) -> bytes | None:
        try:
            data = await sandbox.read_file(path, max_bytes=MAX_OUTPUT + 1)  # a byte past the cap: is there more?
        except SandboxFileNotFoundError:
            return None
        if len(data) > MAX_OUTPUT:
            # read whole, as Harbor reads it, or not at all: "1", a megabyte of blanks and "0" was read as 1
            raise HarborRewardError(f"{path} is over {MAX_OUTPUT} bytes")
        return data

    def episode_timeout_s(self, task: Task) -> float:
        """[agent] timeout_sec: the agent's whole run, as Harbor's (then test.sh scores what it left)."""
        return self.harbor_tasks[task.id].agent_timeout_s

    def scoring_timeout_s(self, task: Task) -> float:
        """test.sh at its timeout and the grader's four steps around it, twice for a validated task (it runs once
        more after a timeout), then the look at /tmp and at the host's pace."""
        t = self.harbor_tasks[task.id]
        runs = 2 if self.validated else 1
        return runs * (t.verifier_timeout_s + 4 * self.tool_timeout_s) + 2 * TMP_CHECK_S + PROBE_TIMEOUT_S

    async def score(self, sandbox: Sandbox, task: Task, episode: Episode) -> Score:
        """Upload tests/, run test.sh as Harbor does and read its reward. When the verifier cannot do its part (no
        reward, a timeout, a step of the grader's failed), the sandbox as the agent left it is why, and that is the
        agent's own outcome, 0 (never a rollout masked from training), if the agent filled /tmp, where /tests and
        /logs live, or if the task was validated: its test.sh wrote a reward in time for the oracle and for an empty
        solution (one that ran past its timeout runs once more first: a busy host's doing is no reward). Otherwise
        the task is not known to work: ENV_ERROR."""
        t = self.harbor_tasks[task.id]
        try:
            try:
                return await self._verify(sandbox, t)
            except VerifierTimeoutError as e:
                if not self.validated:
                    raise
                # test.sh finished in time in validation: past its timeout now, it ran the agent's program that
                # never ends (it does so again) or a host was too busy to run it in time (a second run most likely
                # finishes): a 0 for the host's doing would be an infrastructure failure passed off as a reward
                log.info("%s: %s; running it once more", task.id, e)
                score = await self._verify(sandbox, t)
                return Score(score.reward, score.components, {**score.metrics, VERIFIER_RERUN_METRIC: 1.0})
        except (HarborRunError, SandboxFileError) as e:  # a step of the grader's, or a file it wrote or read
            if await self._tmp_full(sandbox, t.tests):
                log.info("%s: the agent filled /tmp, so the verifier could not run (%s); scored 0", task.id, e)
                return Score(0.0, {}, {TMP_FULL_METRIC: 1.0})
            if not self.validated:
                raise
            # twice past its timeout, or a step of the grader's failed: on a host too busy to run a shell that does
            # nothing in time, that is the host's doing (INFRA_ERROR, retried), never a 0. A shell the agent broke
            # fails in time: the host keeps time, and the agent's doing scores 0
            await keeps_time(sandbox, f"{task.id}: the verifier failed ({e})")
            log.info("%s: the verifier failed after the agent's turn, not in validation (%s); scored 0", task.id, e)
            return Score(0.0, {}, {VERIFIER_FAILED_METRIC: 1.0})

    async def _tmp_full(self, sandbox: Sandbox, tests: Mapping[str, bytes]) -> bool:
        """Whether /tmp has no room left for what the grader writes there (tests/, the reward, a HOME); an answer
        that cannot be read is no."""
        try:
            df = "df -Pk /tmp | tail -n 1; df -Pi /tmp | tail -n 1"
            r = await sandbox.exec(["/bin/sh", "-c", df], cwd="/", env=GRADER_PATH, timeout=TMP_CHECK_S)
            kib, inodes = (int(line.split()[3]) for line in r.stdout.decode().splitlines()[-2:])
        except (SandboxError, ValueError, IndexError):
            return False
        need_kib = sum(len(data) for data in tests.values()) // 1024 + GRADER_SLACK_KIB
        return kib < need_kib or inodes < len(tests) + GRADER_SLACK_INODES

    async def _verify(self, sandbox: Sandbox, t: HarborTask) -> Score:
        # the agent owns /tmp/harbor: a link it left on the way to /tests or /logs/verifier (taken through the
        # links of /tests and /logs) made the grader's upload or read fail, an ENV_ERROR instead of its 0. And their
        # modes: Harbor's verifier is root, whom no mode stops; ours is the agent's uid, and a `chmod 000` of the
        # workspace (test.sh's workdir) or of the logs made the verifier fail, an ENV_ERROR for a task not validated.
        # Each folder, parent first, is opened before what is in it is looked at: a link under a `chmod 000`
        # /tmp/harbor could not be seen (lstat refused) and stayed. With no link left on the way, chmod -R changes
        # nothing outside (it follows none it meets); what it cannot change (a folder gone) the next steps say
        path = " ".join(f"{RUNTIME}{p}" for p in ("", "/tests", "/logs", "/logs/verifier"))
        reclaim = (
            f'for d in {path}; do if [ -L "$d" ] || [ -e "$d" -a ! -d "$d" ]; then rm -f -- "$d"; '
            'elif [ -d "$d" ]; then chmod u+rwx -- "$d"; fi; done'
        )
        tree = " ".join(f"{RUNTIME}{p}" for p in ("/tests", "/logs"))
        reclaim += f"; chmod u+rwx /workspace 2>/dev/null; chmod -R u+rwX -- {tree} 2>/dev/null; true"
        await self._sh(sandbox, reclaim, self.tool_timeout_s, "reclaiming the grader's paths")
        await self._upload(sandbox, t, "tests")
        # whatever the agent left in /logs/verifier is not a reward
        verifier = VERIFIER_DIR
        await self._sh(sandbox, f"rm -rf {verifier} && mkdir -p {verifier}", self.tool_timeout_s, "clearing logs")
        home = await self._verifier_home(sandbox, t.verifier_env)
        # the clean grader's environment over the task's (which may not name its Python variables, load_task): no
        # user site, and a HOME the agent could not write to, so nothing it left there runs in the verifier's
        # pythons or tools (git's config, pip's, npm's)
        r = await sandbox.exec(
            _in(t.workdir, "/tests/test.sh"),
            env={**t.verifier_env, **GRADER_ENV, "HOME": home},
            timeout=t.verifier_timeout_s,
            max_output=MAX_OUTPUT,
        )
        if r.timed_out:
            raise VerifierTimeoutError(
                f"tests/test.sh timed out after {t.verifier_timeout_s:g}s ([verifier] timeout_sec)"
            )
        txt = await self._read(sandbox, f"{VERIFIER_DIR}/reward.txt")
        js = await self._read(sandbox, f"{VERIFIER_DIR}/reward.json")
        try:
            reward, components = parse_reward(txt, js)
        except HarborRewardError as e:
            raise HarborRewardError(f"{e} (test.sh exit {r.exit_code}; output: {_tail(r) or '(none)'})") from None
        return Score(reward, components, {"test_exit_code": float(r.exit_code)})


def load_tasks(dirs: Sequence[Path]) -> dict[str, HarborTask]:
    """Parse every directory; they must have distinct ids and one shared environment (one image)."""
    if not dirs:
        raise HarborTaskError("no task directories")
    tasks: dict[str, HarborTask] = {}
    for d in dirs:
        t = load_task(d)
        if t.id in tasks:
            raise HarborTaskError(f"two task directories are named {t.id!r}: {tasks[t.id].path} and {t.path}")
        tasks[t.id] = t
    first = next(iter(tasks.values()))
    others = [t.id for t in tasks.values() if t.environment_key() != first.environment_key()]
    if others:
        raise HarborTaskError(
            f"tasks {', '.join(others[:5])} have a different environment/ (or docker_image, workdir, env) than "
            f"{first.id}; an environment has one image: import them as separate environments"
        )
    built_dockerfile(first)  # the image's whole Dockerfile passes the checks before anything is built
    return tasks


def _limits(tasks: Sequence[HarborTask]) -> Limits:
    """[environment] cpus, memory_mb and storage_mb (the workspace's cap): the largest over the tasks."""
    d = DEFAULT_LIMITS
    mem = max((t.memory_mb for t in tasks if t.memory_mb), default=d.memory_mb)
    cpus = max((t.cpus for t in tasks if t.cpus), default=d.cpus)
    storage = max((t.storage_mb for t in tasks if t.storage_mb), default=d.workspace_mb)
    return Limits(memory_mb=mem, cpus=cpus, pids=d.pids, tmp_mb=d.tmp_mb, workspace_mb=storage)


def _workdir_note(workdir: str) -> str:
    if workdir == "/workspace":
        return ""
    return (
        f" The working directory {workdir} is /workspace: give the file tools paths under /workspace "
        f"(or relative ones); bash can use {workdir}."
    )


def make_harbor_environment(
    name: str, dirs: Sequence[Path], version: str = "1", *, validated: bool = False
) -> HarborEnvironment:
    """The environment of these task directories (parsed and checked now: a HarborTaskError names the problem);
    `validated`: every task passed validate.py on its image (import-harbor's, or the server's at registration)."""
    tasks = load_tasks([Path(d) for d in dirs])
    attrs: dict[str, Any] = {
        "task_dirs": tuple(t.path for t in tasks.values()),
        "name": name,
        "version": version,
        "description": f"{len(tasks)} Harbor task(s)",
        "limits": _limits(list(tasks.values())),
        "system_prompt": SYSTEM_PROMPT + _workdir_note(next(iter(tasks.values())).workdir),
        # one tool call's cap: the agent's whole time, within what an environment's tool_timeout_s may be
        "tool_timeout_s": min(MAX_TOOL_TIMEOUT_S, max(60.0, min(t.agent_timeout_s for t in tasks.values()))),
        "validated": validated,
        "__doc__": f"The Harbor environment {name}@{version}.",
    }
    cls: type[HarborEnvironment] = type(f"Harbor({name}@{version})", (HarborEnvironment,), attrs)
    env = cls()
    env.__dict__["harbor_tasks"] = tasks  # already parsed
    return env


def mark_validated(env: HarborEnvironment) -> HarborEnvironment:
    """`env` once every task passed validate.py on its image (its class is this load's own)."""
    type(env).validated = True
    return env


def from_manifest(path: Path) -> HarborEnvironment:
    """The environment a manifest (JSON) describes; relative task paths are relative to the manifest."""
    doc = json.loads(path.read_text())
    dirs = [(path.parent / d) for d in doc["tasks"]]
    validated = doc.get("validated") is True  # written by import-harbor once every task passed
    return make_harbor_environment(str(doc["name"]), dirs, str(doc.get("version", "1")), validated=validated)
