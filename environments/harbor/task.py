"""Harbor (Terminal-Bench) task directories: `task.toml`, `instruction.md`, `environment/`, `solution/`, `tests/`.

`load_task` reads one directory with tomllib and refuses what a sandbox cannot honour (a network, a non-envfleet
prebuilt image, a Dockerfile that reaches outside its build) with a message naming the task and the field.
"""

from __future__ import annotations

import hashlib
import logging
import math
import posixpath
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.core.echo import echo
from orchestrator.core.environment import GRADER_ENV, MAX_SCORE_NAMES
from orchestrator.core.errors import FailedPreconditionError, InvalidRequestError
from orchestrator.core.models import MAX_REWARD
from orchestrator.service.declarative import dockerfile as dockerfile_check

log = logging.getLogger(__name__)

TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_WORKDIR = re.compile(r"^/[A-Za-z0-9._/-]*$")
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,255}$")
# where the agent and test.sh run when neither task.toml nor the Dockerfile's last stage says (Harbor's tasks
# mostly set WORKDIR /app)
DEFAULT_WORKDIR = "/app"
# What a workdir may not be, nor lie under: it becomes a link to /workspace, which the agent writes, and what the
# image had there is moved out. Where the sandbox mounts its own (tmpfs, envd, devices) or the image tail puts
# Harbor's paths, it is no link at all; where the grader's commands, libraries and configuration live (its PATH,
# GRADER_PATH; /etc's ld.so.preload), the agent's own `mkdir` or library ran in the grader and wrote the reward.
_KEPT_DIRS = (
    *("/tmp", "/workspace", "/dev", "/proc", "/sys", "/run", "/var/run", "/var/tmp", "/boot"),
    *("/logs", "/tests", "/solution", "/opt/harbor", "/opt/envfleet"),
    *("/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"),
    *("/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32", "/usr/libexec", "/usr/local"),
)
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
DEFAULT_BUILD_TIMEOUT_S = 600.0
MAX_FILE_BYTES = 16 << 20
# arrays and inline tables nested in a task.toml: tomllib recurses once a level, and a document nested thousands deep
# was refused only by the RecursionError it raised, deep in the stack, where a garbage collection that ran a failing
# finalizer could not even report it (the process's own error hook ran out of stack)
MAX_TOML_DEPTH = 64
MAX_TIMEOUT_S = 86_400.0  # any timeout_sec of a task
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT])i?B?", re.IGNORECASE)


class HarborTaskError(InvalidRequestError):
    """A task directory that cannot be imported (the message names the task and the problem)."""


class HarborRunError(FailedPreconditionError):
    """A step of the environment failed in the sandbox (setup, upload): ENV_ERROR."""


class HarborRewardError(HarborRunError):
    """test.sh left no usable reward (missing, empty, NaN, not a number): the environment is broken, never a 0."""


@dataclass(frozen=True)
class HarborTask:
    """One parsed task directory."""

    id: str
    path: Path
    instruction: str
    dockerfile: str | None  # environment/Dockerfile; None when [environment] docker_image names the image
    docker_image: str | None
    workdir: str
    env: dict[str, str]
    cpus: float | None
    memory_mb: int | None
    storage_mb: int | None
    build_timeout_s: float
    agent_timeout_s: float
    verifier_timeout_s: float
    verifier_env: dict[str, str]
    solution_env: dict[str, str]  # [solution] env: solve.sh's, as Harbor's oracle runs it
    tests: dict[str, bytes] = field(repr=False)  # relative path -> bytes (tests/, uploaded after the episode)
    solution: dict[str, bytes] = field(repr=False)  # solution/
    context: dict[str, bytes] = field(repr=False)  # environment/ (the build context)
    # the files of those three folders that are executable, as "tests/run.py", "environment/gradlew": Harbor builds
    # from the folder and copies it as it is, so a `./gradlew`, a checker test.sh runs directly, ran there
    executables: frozenset[str] = frozenset()

    def environment_key(self) -> str:
        """A hash of everything that makes the image: tasks of one environment must share it."""
        h = hashlib.sha256()
        for k, v in sorted(self.context.items()):
            # one byte, always: the executable bit of a file the build copies (the Dockerfile's never reaches it)
            executable = k != "Dockerfile" and f"environment/{k}" in self.executables
            h.update(k.encode() + b"\0" + hashlib.sha256(v).digest() + (b"\1" if executable else b"\0"))
        h.update(repr((self.docker_image, self.workdir, sorted(self.env.items()))).encode())
        return h.hexdigest()


def _files(root: Path, task: str, what: str, executables: set[str] | None = None) -> dict[str, bytes]:
    """The files of a task's folder by relative path. A link is refused, the folder itself too: an uploaded archive
    keeps links that stay inside it, and a hundred tasks whose tests/ each link to one task's re-read its files a
    hundred times past every cap that counted them once."""
    if root.is_symlink():
        raise HarborTaskError(f"task {task}: {what} is a symlink; copy the folder instead")
    if not root.is_dir():
        return {}
    out: dict[str, bytes] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if not _is_text(rel):
            raise HarborTaskError(
                f"task {task}: {what}/ holds a file whose name is not UTF-8 ({rel.encode(errors='replace')!r})"
            )
        if p.is_symlink():
            raise HarborTaskError(f"task {task}: {what}/{rel} is a symlink; copy the file instead")
        if p.is_file():
            st = p.stat()
            if st.st_size > MAX_FILE_BYTES:
                raise HarborTaskError(f"task {task}: {what}/{rel} is over {MAX_FILE_BYTES >> 20} MiB")
            out[rel] = p.read_bytes()
            if executables is not None and st.st_mode & 0o111:
                executables.add(f"{what}/{rel}")  # "what/rel": HarborTask.executables
    return out


def _is_text(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:  # a byte that is not UTF-8, as the file system's surrogate escape
        return False
    return True


def _text(path: Path, task: str) -> str | None:
    """A task file's UTF-8 text, None when there is none; HarborTaskError when it is a link, a folder or not UTF-8."""
    if path.is_symlink():
        raise HarborTaskError(f"task {task}: {path.name} is a symlink; copy the file instead")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise HarborTaskError(f"task {task}: {path.name} is not UTF-8 text") from None
    except OSError as e:  # a folder, say
        raise HarborTaskError(f"task {task}: {path.name} cannot be read as a file ({e.strerror})") from None


def _shown(v: object) -> str:
    """A task.toml value in a message: a scalar cut short, else its type (a table nested by 50,000 dotted keys made
    repr() raise RecursionError, and the import an internal error)."""
    return echo(v) if isinstance(v, str | int | float | bool) else f"a {type(v).__name__}"


def _table(doc: dict[str, Any], name: str, task: str) -> dict[str, Any]:
    t = doc.get(name, {})
    if not isinstance(t, dict):
        raise HarborTaskError(f"task {task}: [{name}] in task.toml must be a table")
    return t


def _number(
    t: dict[str, Any],
    key: str,
    section: str,
    task: str,
    default: float | None,
    least: float = 0.0,
    most: float = math.inf,
) -> float | None:
    v = t.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise HarborTaskError(f"task {task}: [{section}] {key} must be a positive number, not {_shown(v)}")
    if not least <= v <= most:
        bound = f"under {least:.15g}" if v < least else f"over {most:.15g}"
        raise HarborTaskError(f"task {task}: [{section}] {key} = {_shown(v)} is {bound}")
    if key.endswith("_sec") and v > MAX_TIMEOUT_S:
        # a socket's timeout past what it takes raised OverflowError out of the build, uncaught
        raise HarborTaskError(f"task {task}: [{section}] {key} = {_shown(v)} is over {MAX_TIMEOUT_S:g}s (a day)")
    return float(v)


def _megabytes(t: dict[str, Any], key: str, task: str, least: float, most: float) -> int | None:
    """[environment] `key`_mb, or Harbor's older `key` = "4G" / "512M" (it was ignored, and the default used)."""
    if f"{key}_mb" in t or key not in t:
        mb = _number(t, f"{key}_mb", "environment", task, None, least, most)
        return None if mb is None else int(mb)
    v = t[key]
    m = _SIZE.fullmatch(v.strip()) if isinstance(v, str) else None
    if m is None:
        raise HarborTaskError(f'task {task}: [environment] {key} = {_shown(v)}: give {key}_mb = <MB> (or "4G")')
    mb = float(m[1]) * {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}[m[2].upper()]
    return int(_number({f"{key}_mb": mb}, f"{key}_mb", "environment", task, None, least, most) or 0)


def _env(t: dict[str, Any], section: str, task: str) -> dict[str, str]:
    env = t.get("env", {})
    if not isinstance(env, dict):
        raise HarborTaskError(f"task {task}: [{section}] env must be a table of strings")
    out: dict[str, str] = {}
    for k, v in env.items():
        if not _ENV_NAME.fullmatch(k) or not isinstance(v, str | int | float) or isinstance(v, bool):
            raise HarborTaskError(f"task {task}: [{section}] env {k!r} must be NAME = string")
        s = str(v)
        # the image's environment is written as Dockerfile ENV lines: keep values that need no escaping there
        if any(c in s for c in '\n\r\0"\\$'):
            raise HarborTaskError(
                f"task {task}: [{section}] env {k}: a newline, quote, backslash or $ is not supported"
            )
        out[k] = s
    return out


def _solution_env(t: dict[str, Any], task: str) -> dict[str, str]:
    """[solution] env: solve.sh's environment at validation, given to its exec (no Dockerfile line), so any value
    goes but one with a NUL; what cannot be used is logged and left out, never a task refused that loaded before it
    was read (a `${VAR}` Harbor fills from its host goes as written)."""
    env = t.get("env", {})
    if not isinstance(env, dict):
        log.warning("task %s: [solution] env is not a table; ignored", task)
        return {}
    out: dict[str, str] = {}
    for k, v in env.items():
        if not isinstance(k, str) or not _ENV_NAME.fullmatch(k) or not isinstance(v, str | int | float):
            log.warning("task %s: [solution] env %s is not NAME = string; ignored", task, _shown(k))
        elif isinstance(v, bool) or "\0" in str(v):
            log.warning("task %s: [solution] env %s holds a NUL or a boolean; ignored", task, _shown(k))
        else:
            out[k] = str(v)
    return out


WORKDIR_RULE = "not /, nor a system or sandbox folder such as /usr/local/bin, /etc, /tmp, /opt, /workspace/x or /logs"


def _workdir(v: object) -> str | None:
    """`v` as a workdir the image tail can make a link to /workspace (normalized: `/./tmp` is /tmp), or None: not an
    absolute path of plain names, `..` in it, `/`, one of _KEPT_DIRS or under one, or a folder that holds one (/opt,
    /usr: moved out of the image whole)."""
    if not isinstance(v, str) or not _WORKDIR.fullmatch(v) or ".." in v.split("/") or v.startswith("//"):
        return None
    v = posixpath.normpath(v)
    if v == "/workspace":
        return v
    if v == "/" or any(v == d or v.startswith(d + "/") or d.startswith(v + "/") for d in _KEPT_DIRS):
        return None
    return v


def _dockerfile_workdir(text: str, task: str) -> str | None:
    """The working directory the Dockerfile leaves its last stage in (its last WORKDIR, a relative one joined to
    the one before, a stage FROM an earlier stage starting in that stage's), where Harbor runs the agent and
    test.sh (normalized, as the builder cleans it); None when the last stage sets none, and the caller's default
    stands (DEFAULT_WORKDIR: not the base image's /workspace, where Harbor's tasks keep nothing). One this cannot
    read for sure (a variable, quotes, `..`, a relative one after an image's FROM) or that cannot be the workdir
    (_workdir: /, /tmp, /usr/local/bin...) is said and left to the default: [environment] workdir names another."""
    stages: list[tuple[set[str], str | None]] = []  # (the stage's index and name, lower case; its workdir)
    current: str | None = None
    line = 0
    for i in dockerfile_check.parse(text):
        if i.keyword == "FROM":
            words = [w.lower() for w in i.args.split() if not w.startswith("--")]
            current = next((w for keys, w in reversed(stages) if words and words[0] in keys), None)
            keys = {str(len(stages)), *(words[2:3] if len(words) >= 3 and words[1] == "as" else [])}
            stages.append((keys, current))
        elif i.keyword == "WORKDIR" and stages:
            arg, line = i.args.strip(), i.line
            # relative: to the one before; after a FROM of an image, to that image's, unknown here ("?" stays)
            current = re.sub("/+", "/", arg if arg.startswith("/") else f"{current or '?'}/{arg}").rstrip("/") or "/"
            stages[-1] = (stages[-1][0], current)
    if current is None:
        return None
    workdir = _workdir(current)
    if workdir is None:
        log.warning(
            "task %s: environment/Dockerfile line %d: the last WORKDIR, %s, is not a plain path this reads, or is "
            "one that cannot become the agent's workspace (%s); the workdir is %s: give [environment] workdir = "
            '"/path" in task.toml',
            task,
            line,
            echo(current),
            WORKDIR_RULE,
            DEFAULT_WORKDIR,
        )
    return workdir


def _nested_deeper(text: str, limit: int) -> bool:
    """Whether TOML text opens more than `limit` arrays or inline tables inside each other, or tables by a dotted
    key or header (`a.b.c = 1`, `[a.b.c]`), its strings and comments left out (a string it misreads can only count
    too few: tomllib's own RecursionError stays the backstop). 50,000 dotted levels took tomllib 20-40 s."""
    depth, dots, i, n = 0, 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == ".":
            dots += 1
            if depth + dots > limit:
                return True
        elif c in "=\n,{}]":
            dots = 0
        if c == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif c in "\"'":
            if text.startswith(c * 3, i):  # a multi-line string
                end = text.find(c * 3, i + 3)
                i = n if end < 0 else end + 2
            else:
                i += 1
                while i < n and text[i] != c and text[i] != "\n":
                    i += 2 if c == '"' and text[i] == "\\" else 1
        elif c in "[{":
            depth += 1
            if depth > limit:
                return True
        elif c in "]}":
            depth = max(0, depth - 1)
        i += 1
    return False


def load_task(path: Path) -> HarborTask:
    """Parse and check one Harbor task directory (the task id is its folder name)."""
    path = path.resolve()
    task = path.name
    if not path.is_dir():
        raise HarborTaskError(f"{path} is not a task directory")
    if not TASK_ID.fullmatch(task):
        raise HarborTaskError(f"task folder name {task!r} is not a valid task id ({TASK_ID.pattern})")
    toml = _text(path / "task.toml", task)
    if toml is None:
        raise HarborTaskError(f"task {task}: no task.toml in {path}")
    if _nested_deeper(toml, MAX_TOML_DEPTH):
        raise HarborTaskError(f"task {task}: task.toml: nested too deeply (over {MAX_TOML_DEPTH} levels)")
    try:
        doc = tomllib.loads(toml)
    except RecursionError:
        raise HarborTaskError(f"task {task}: task.toml: nested too deeply") from None
    except ValueError as e:  # TOMLDecodeError, or an integer of thousands of digits
        raise HarborTaskError(f"task {task}: task.toml: {e}") from None
    instruction = _text(path / "instruction.md", task)
    if instruction is None:
        raise HarborTaskError(f"task {task}: no instruction.md (the prompt)")
    if not instruction.strip():
        raise HarborTaskError(f"task {task}: instruction.md is empty")
    agent, envt, verifier = (_table(doc, n, task) for n in ("agent", "environment", "verifier"))
    solution = doc.get("solution", {})  # read only for solve.sh's env: one of another shape is no task refused
    if not isinstance(solution, dict):
        log.warning("task %s: [solution] in task.toml is not a table; ignored", task)
        solution = {}
    network = envt.get("network_mode", "no-network")
    if network != "no-network":
        raise HarborTaskError(
            f"task {task}: [environment] network_mode = {_shown(network)}: envfleet sandboxes have no network; "
            "only 'no-network' tasks can be imported"
        )
    # what a sandbox cannot give, though many tasks ask for it without needing it (allow_internet = true is
    # Harbor's default and its template's): said, and left to the oracle's run to show whether the task works
    # (refused, archives registered before were dropped at the next start)
    unmet = [f"{k} = {_shown(envt[k])}" for k in ("allow_internet", "gpus", "gpu_types", "tpu") if envt.get(k)]
    if envt.get("os", "linux") != "linux":
        unmet.append(f"os = {_shown(envt['os'])}")
    if unmet:
        log.warning(
            "task %s: [environment] %s: envfleet sandboxes have no network and no accelerators and run Linux; the "
            "task must work without",
            task,
            ", ".join(unmet),
        )
    named = envt.get("workdir")
    workdir = None if named is None else _workdir(named)
    if named is not None and workdir is None:
        raise HarborTaskError(
            f"task {task}: [environment] workdir {_shown(named)} must be an absolute directory path that can become "
            f"the agent's workspace ({WORKDIR_RULE})"
        )
    executables: set[str] = set()
    context = _files(path / "environment", task, "environment", executables)
    compose = sorted(n for n in context if n in ("docker-compose.yaml", "docker-compose.yml", "compose.yaml"))
    if compose:
        log.warning("task %s: environment/%s is not read: a sandbox is one container", task, compose[0])
    image = envt.get("docker_image")
    dockerfile: str | None = None
    if image is not None:
        if (
            not isinstance(image, str)
            or not _IMAGE.match(image)
            or not image.startswith(dockerfile_check.ENVFLEET_IMAGE_PREFIX)
        ):
            raise HarborTaskError(
                f"task {task}: [environment] docker_image {_shown(image)} is not an envfleet image; builds are "
                "offline and sandboxes need envd: give an environment/Dockerfile FROM envfleet/base"
            )
        try:  # the image becomes a FROM line: the same rules (not another environment's image, no variable)
            dockerfile_check.check(f"FROM {image}\n")
        except InvalidRequestError as e:
            raise HarborTaskError(f"task {task}: [environment] docker_image: {e}") from None
    else:
        if "Dockerfile" not in context:
            raise HarborTaskError(f"task {task}: no environment/Dockerfile and no [environment] docker_image")
        dockerfile = context["Dockerfile"].decode(errors="replace")
        try:
            dockerfile_check.check(dockerfile)
        except InvalidRequestError as e:
            raise HarborTaskError(f"task {task}: environment/Dockerfile: {e}") from None
        if workdir is None:
            workdir = _dockerfile_workdir(dockerfile, task)
    if workdir is None:
        workdir = DEFAULT_WORKDIR
    verifier_env = _env(verifier, "verifier", task)
    # test.sh runs with the clean grader's Python variables over the task's: a user site directory let a
    # usercustomize.py the agent planted run in the verifier's pythons (its HOME: see HarborEnvironment.score)
    python = {k: v for k, v in GRADER_ENV.items() if k.startswith("PYTHON")}
    clash = sorted(verifier_env.keys() & python.keys())
    if clash:
        raise HarborTaskError(
            f"task {task}: [verifier] env {clash[0]}: the verifier runs with envfleet's clean grader environment "
            f"({', '.join(f'{k}={v}' for k, v in python.items())}), which the task cannot change; remove it"
        )
    tests = _files(path / "tests", task, "tests", executables)
    if "test.sh" not in tests:
        raise HarborTaskError(f"task {task}: no tests/test.sh")
    # within what a sandbox takes (Limits): past it, the whole import failed on a message naming no task
    memory = _megabytes(envt, "memory", task, least=16, most=1 << 20)
    storage = _megabytes(envt, "storage", task, least=1, most=1 << 20)
    return HarborTask(
        id=task,
        path=path,
        instruction=instruction,
        dockerfile=dockerfile,
        docker_image=image,
        workdir=workdir.rstrip("/"),
        env=_env(envt, "environment", task),
        cpus=_number(envt, "cpus", "environment", task, None, least=0.01, most=1024),
        memory_mb=memory,
        storage_mb=storage,
        build_timeout_s=_number(envt, "build_timeout_sec", "environment", task, DEFAULT_BUILD_TIMEOUT_S) or 0.0,
        agent_timeout_s=_number(agent, "timeout_sec", "agent", task, DEFAULT_AGENT_TIMEOUT_S) or 0.0,
        verifier_timeout_s=_number(verifier, "timeout_sec", "verifier", task, DEFAULT_VERIFIER_TIMEOUT_S) or 0.0,
        verifier_env=verifier_env,
        solution_env=_solution_env(solution, task),
        tests=tests,
        solution=_files(path / "solution", task, "solution", executables),
        context=context,
        executables=frozenset(executables),
    )


def _finite(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer past a float's range
        return None
    return f if math.isfinite(f) else None


def _bounded(reward: float, where: str) -> float:
    """A reward within ±MAX_REWARD: past it a Score refuses it (ENV_ERROR), where the verifier's number, which
    test.sh may take from the agent's program, is a failed verifier's case (0 in a validated task)."""
    if abs(reward) > MAX_REWARD:
        raise HarborRewardError(f"{where}: the reward {reward:g} is past ±{MAX_REWARD:g}")
    return reward


def parse_reward(txt: bytes | None, js: bytes | None) -> tuple[float, dict[str, float]]:
    """Harbor's rule: reward.txt (one float) wins over reward.json (an object of finite numbers). The scalar is
    its "reward" key, else the mean of its values; anything missing, empty or non-numeric is a HarborRewardError."""
    if txt is not None:
        text = txt.decode(errors="replace").strip()
        if not text:
            raise HarborRewardError("test.sh wrote an empty /logs/verifier/reward.txt")
        try:
            value = _finite(float(text))
        except ValueError:
            value = None
        if value is None:
            raise HarborRewardError(f"/logs/verifier/reward.txt is not a finite number: {text[:200]!r}")
        return _bounded(value, "/logs/verifier/reward.txt"), {}
    if js is None:
        raise HarborRewardError("test.sh wrote neither /logs/verifier/reward.txt nor /logs/verifier/reward.json")
    if not js.strip():
        raise HarborRewardError("test.sh wrote an empty /logs/verifier/reward.json")
    import json

    try:
        doc = json.loads(js)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, an integer of over 4,300 digits, nested deep
        raise HarborRewardError(f"/logs/verifier/reward.json is not JSON this reads: {e}"[:500]) from None
    if not isinstance(doc, dict) or not doc:
        raise HarborRewardError("/logs/verifier/reward.json must be a non-empty object of numbers")
    values: dict[str, float] = {}
    for k, v in doc.items():
        f = _finite(v)
        if f is None:
            raise HarborRewardError(f"/logs/verifier/reward.json: {k!r} is {v!r}, not a finite number")
        values[str(k)] = f
    # each value divided first: two values near a float's limit have a finite mean and an infinite sum
    reward = _bounded(
        values["reward"] if "reward" in values else sum(v / len(values) for v in values.values()),
        "/logs/verifier/reward.json",
    )
    if len(values) > MAX_SCORE_NAMES:
        # a verifier's result per test: the reward stands, its keys are too many to keep as components
        return reward, {}
    return reward, values
