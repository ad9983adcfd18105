"""Harbor task directories on real sandboxes: the image built offline from environment/Dockerfile, the oracle and
the empty solution, every reward form of test.sh, and the failures that are ENV_ERROR (never a 0)."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Mapping
from pathlib import Path

import docker
import pytest
from rich.console import Console

from environments.harbor.cli import import_harbor, register
from environments.harbor.env import HarborEnvironment, from_manifest, make_harbor_environment
from environments.harbor.task import HarborRewardError, HarborTaskError, load_task, parse_reward
from environments.harbor.validate import check_task
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.core.environment import Score
from orchestrator.core.errors import ImageBuildError

DOCKERFILE = """FROM envfleet/base:latest
WORKDIR /app
RUN printf 'hello\\n' > /app/greeting.txt && mkdir -p /app/src
"""
TOML = """version = "1.0"
[metadata]
difficulty = "easy"
[agent]
timeout_sec = 60
[verifier]
timeout_sec = {verifier_timeout}
env = {{ EXPECT = "HELLO" }}
[environment]
build_timeout_sec = 300
cpus = 1
memory_mb = 768
storage_mb = 64
"""
# uppercase greeting.txt into out.txt, and a second file: a multi-file solution
SOLVE = """#!/bin/bash
set -e
tr a-z A-Z < greeting.txt > out.txt
bash /solution/helper.sh
"""
HELPER = "echo done > /app/src/marker\n"
TEST_TXT = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/out.txt 2>/dev/null)" = "$EXPECT" ] && [ -f src/marker ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
TEST_JSON = """#!/bin/bash
mkdir -p /logs/verifier
ok=0; [ "$(cat out.txt 2>/dev/null)" = "$EXPECT" ] && ok=1
m=0; [ -f /app/src/marker ] && m=1
printf '{"correct": %s, "marker": %s, "style": 0.5}' $ok $m > /logs/verifier/reward.json
"""


def make_task(
    root: Path,
    name: str,
    *,
    test: str = TEST_TXT,
    solve: str = SOLVE,
    extra_solution: Mapping[str, str] | None = None,
    dockerfile: str = DOCKERFILE,
    verifier_timeout: int = 60,
    toml_extra: str = "",
) -> Path:
    d = root / name
    files = {
        "task.toml": TOML.format(verifier_timeout=verifier_timeout) + toml_extra,
        "instruction.md": "Write greeting.txt in upper case to out.txt.\n",
        "environment/Dockerfile": dockerfile,
        "solution/solve.sh": solve,
        "tests/test.sh": test,
        **({"solution/helper.sh": HELPER} if extra_solution is None else dict(extra_solution)),
    }
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


@pytest.fixture(scope="module")
def tasks_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("harbor")
    make_task(root, "upper-txt")
    make_task(root, "upper-json", test=TEST_JSON)
    make_task(
        root, "slow-tests", test="#!/bin/bash\nsleep 30\necho 1 > /logs/verifier/reward.txt\n", verifier_timeout=2
    )
    make_task(root, "wrong-oracle", solve="#!/bin/bash\necho nope > out.txt\n")
    make_task(root, "no-reward", test="#!/bin/bash\necho 'tests ran, reward forgotten'\n")
    make_task(root, "nan-reward", test="#!/bin/bash\necho nan > /logs/verifier/reward.txt\n")
    return root


@pytest.fixture(scope="module")
def env(tasks_root: Path) -> HarborEnvironment:
    dirs = sorted(p for p in tasks_root.iterdir() if p.is_dir())
    return make_harbor_environment("harbor-test", dirs)


@pytest.fixture(scope="module")
def image(env: HarborEnvironment, base_image: str, docker_client: docker.DockerClient) -> str:
    return env.build_image(docker_client)


def test_task_toml_maps_to_limits_prompt_and_timeouts(env: HarborEnvironment) -> None:
    t = env.harbor_tasks["upper-txt"]
    assert t.verifier_env == {"EXPECT": "HELLO"} and t.verifier_timeout_s == 60 and t.workdir == "/app"
    assert env.limits.memory_mb == 768 and env.limits.workspace_mb == 64 and env.limits.cpus == 1
    assert {x.id: x.prompt for x in env.tasks()}["upper-txt"].startswith("Write greeting.txt")
    assert "bash" in env.tools and "write_file" in env.tools
    assert "ln -sfn /workspace /app" in env.dockerfile()


def test_network_and_foreign_images_are_refused(tmp_path: Path) -> None:
    with pytest.raises(HarborTaskError, match="sandboxes have no network"):
        load_task(make_task(tmp_path, "net", toml_extra='network_mode = "bridge"\n'))
    with pytest.raises(HarborTaskError, match="not an envfleet image"):
        load_task(make_task(tmp_path, "ubuntu", dockerfile="FROM ubuntu:24.04\nRUN true\n"))
    with pytest.raises(HarborTaskError, match=r"no tests/test\.sh"):
        d = make_task(tmp_path, "notest")
        (d / "tests" / "test.sh").unlink()
        load_task(d)


def test_a_prebuilt_envfleet_image_is_the_base(tmp_path: Path) -> None:
    d = make_task(tmp_path, "prebuilt", toml_extra='docker_image = "envfleet/base:latest"\nworkdir = "/srv/task"\n')
    (d / "environment" / "Dockerfile").unlink()
    env = make_harbor_environment("prebuilt", [d])
    assert (
        env.dockerfile().startswith("FROM envfleet/base:latest\n")
        and "ln -sfn /workspace /srv/task" in env.dockerfile()
    )
    assert "/srv/task is /workspace" in env.system_prompt


def test_tasks_with_different_environments_are_refused(tmp_path: Path) -> None:
    a = make_task(tmp_path, "a")
    b = make_task(tmp_path, "b", dockerfile=DOCKERFILE + "RUN echo other > /app/x\n")
    with pytest.raises(HarborTaskError, match="different environment"):
        make_harbor_environment("mixed", [a, b])


def test_reward_rules() -> None:
    assert parse_reward(b"0.25\n", b'{"reward": 1}') == (0.25, {})  # reward.txt wins, as in Harbor
    assert parse_reward(None, b'{"a": 1, "b": 0}') == (0.5, {"a": 1.0, "b": 0.0})
    assert parse_reward(None, b'{"reward": 0.75, "a": 0}')[0] == 0.75
    assert parse_reward(None, b'{"a": 1e12, "b": 1e12}')[0] == 1e12  # the mean, not a sum halved
    assert parse_reward(None, b'{"reward": 1, "runtime_ns": 1e15}')[1]["runtime_ns"] == 1e15  # a component: any size
    # a result per test, past what a score keeps as components: the reward stands (its Score was a ValueError)
    per_test = json.dumps({"reward": 0.5, **{f"test_{i}": i % 2 for i in range(300)}}).encode()
    reward, components = parse_reward(None, per_test)
    assert (reward, components) == (0.5, {}) and Score(reward, components).reward == 0.5
    for txt, js, msg in [
        (None, None, "neither"),
        (b"  \n", None, "empty"),
        (b"nan", None, "not a finite number"),
        (b"yes", None, "not a finite number"),
        (None, b'{"a": "high"}', "not a finite number"),
        (None, b"[1]", "non-empty object"),
        # each was an OverflowError, a ValueError or a RecursionError: ENV_ERROR where a validated task scores 0
        (None, b'{"a": 1' + b"0" * 400 + b"}", "not a finite number"),
        (None, b'{"a": 1' + b"0" * 5000 + b"}", "not JSON"),
        (None, b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        # past what a Score takes (ENV_ERROR, where the agent's program may have written it): a failed verifier's
        (b"1e300", None, r"reward 1e\+300 is past"),
        (None, b'{"a": 1e308, "b": 1e308}', r"reward 1e\+308 is past"),
    ]:
        with pytest.raises(HarborRewardError, match=msg):
            parse_reward(txt, js)


async def test_oracle_passes_with_a_multi_file_solution(
    env: HarborEnvironment, image: str, backend: DockerBackend
) -> None:
    c = await check_task(env, backend, image, "upper-txt")
    assert (c.oracle, c.empty, c.problems) == (1.0, 0.0, [])


async def test_reward_json_with_several_keys(env: HarborEnvironment, image: str, backend: DockerBackend) -> None:
    c = await check_task(env, backend, image, "upper-json")
    # the mean of correct, marker and style: 1, 1, 0.5 for the oracle; 0, 0, 0.5 for the empty solution
    assert c.oracle == pytest.approx(2.5 / 3) and c.empty == pytest.approx(0.5 / 3) and c.problems == []


async def test_a_failing_oracle_fails_validation(env: HarborEnvironment, image: str, backend: DockerBackend) -> None:
    c = await check_task(env, backend, image, "wrong-oracle")
    assert c.oracle == 0.0 and any("does not pass" in p for p in c.problems)


@pytest.mark.parametrize(
    ("task_id", "message"),
    [
        ("slow-tests", "test.sh timed out after 2s"),
        ("no-reward", "neither /logs/verifier/reward.txt nor /logs/verifier/reward.json"),
        ("nan-reward", "not a finite number"),
    ],
)
async def test_unusable_rewards_are_env_errors(
    env: HarborEnvironment, image: str, backend: DockerBackend, task_id: str, message: str
) -> None:
    c = await check_task(env, backend, image, task_id)
    assert c.oracle is None and c.empty is None, c.problems
    assert all(p.startswith(("oracle (solution/solve.sh): ENV_ERROR", "empty solution: ENV_ERROR")) for p in c.problems)
    assert message in c.problems[0]


def test_a_build_that_needs_the_network_fails_with_the_log_tail(
    tmp_path: Path, base_image: str, capsys: pytest.CaptureFixture[str]
) -> None:
    d = make_task(tmp_path, "needs-net", dockerfile="FROM envfleet/base:latest\nRUN pip download six -d /tmp/x\n")
    args = _parse(["envs", "import-harbor", str(d), "--name", "net", "--home", str(tmp_path / "home")])
    with pytest.raises(ImageBuildError) as e:
        import_harbor(args, Console(file=io.StringIO()))
    assert "Builds are offline (no network)" in str(e.value) and "pip download six" in str(e.value)
    assert "last log lines" in str(e.value)
    assert not (tmp_path / "home" / "net").exists()


def _parse(argv: list[str]) -> argparse.Namespace:
    from orchestrator.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "import-harbor" not in sub.choices["envs"]._actions[-1].choices:  # type: ignore[union-attr]
        register(sub)
    return parser.parse_args([*argv, "--owner", "envfleet-test-harbor"])


def test_import_validates_and_saves_a_loadable_environment(
    tasks_root: Path, tmp_path: Path, image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    out = io.StringIO()
    args = _parse(
        [
            "envs",
            "import-harbor",
            str(tasks_root / "upper-txt"),
            str(tasks_root / "upper-json"),
            "--name",
            "upper",
            "--home",
            str(home),
        ]
    )
    assert import_harbor(args, Console(file=out, width=200)) == 0, out.getvalue()
    assert "upper-txt: ok" in out.getvalue() and "environments.harbor.installed:upper" in out.getvalue()
    doc = json.loads((home / "upper" / "harbor.json").read_text())
    assert doc["tasks"] == ["tasks/upper-txt", "tasks/upper-json"] and doc["validated"] is True
    monkeypatch.setenv("ENVFLEET_HARBOR_HOME", str(home))
    from orchestrator.service.registry import Registry

    loaded = Registry().load("environments.harbor.installed:upper")
    assert loaded.ref() == "upper@1" and [t.id for t in loaded.tasks()] == ["upper-txt", "upper-json"]
    assert isinstance(loaded, HarborEnvironment) and loaded.validated  # its verifier failing after an agent is a 0


def test_an_import_without_validation_is_saved_unvalidated(tmp_path: Path) -> None:
    d = make_task(tmp_path, "unchecked")
    home = tmp_path / "home"
    args = _parse(["envs", "import-harbor", str(d), "--name", "unchecked", "--home", str(home), "--no-validate"])
    assert import_harbor(args, Console(file=io.StringIO())) == 0
    doc = json.loads((home / "unchecked" / "harbor.json").read_text())
    assert doc["validated"] is False and not from_manifest(home / "unchecked" / "harbor.json").validated
    # a manifest written before the mark, or by hand with anything but true, is not validated
    for value in ("absent", "yes", 1):
        doc.pop("validated", None)
        if value != "absent":
            doc["validated"] = value
        (home / "unchecked" / "harbor.json").write_text(json.dumps(doc))
        assert not from_manifest(home / "unchecked" / "harbor.json").validated


def test_import_refuses_a_failing_oracle(tasks_root: Path, tmp_path: Path, image: str) -> None:
    out = io.StringIO()
    args = _parse(["envs", "import-harbor", str(tasks_root / "wrong-oracle"), "--name", "bad", "--home", str(tmp_path)])
    assert import_harbor(args, Console(file=out, width=200)) == 1
    assert "does not pass" in out.getvalue() and not (tmp_path / "bad").exists()


async def test_links_the_agent_leaves_on_the_graders_paths_do_not_make_its_attempt_an_env_error(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    # the agent owns /tmp/harbor, where /tests and /logs point: a link left there made the grader's read refuse
    # the path, an ENV_ERROR (masked, never scored) instead of the attempt's reward
    trick = "rm -rf /tmp/harbor/logs; mkdir -p /workspace/l; ln -s /workspace/l /tmp/harbor/logs\n"
    make_task(tmp_path, "linked-logs", solve=SOLVE + trick)
    env = make_harbor_environment("harbor-links", [tmp_path / "linked-logs"])
    c = await check_task(env, backend, env.build_image(docker_client), "linked-logs")
    assert (c.oracle, c.empty, c.problems) == (1.0, 0.0, [])


async def test_executable_files_keep_their_bit_in_the_image_the_tests_and_the_solution(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    # Harbor builds from environment/ and copies tests/ and solution/ as they are: a `./gradlew` the image copies,
    # a checker test.sh runs directly, a helper solve.sh runs directly, each ran there. Here every file but a `.sh`
    # lost its executable bit: the build or the oracle failed with "Permission denied"
    tool = "#!/bin/sh\necho tool-ran\n"
    dockerfile = DOCKERFILE + "COPY tool /usr/local/bin/tool\nRUN tool > /app/built-by-tool\n"
    solve = "#!/bin/bash\nset -e\n/solution/helper\n"
    test = "#!/bin/bash\nmkdir -p /logs/verifier\n/tests/check > /logs/verifier/reward.txt\n"
    d = make_task(tmp_path, "exec-bits", solve=solve, test=test, dockerfile=dockerfile, extra_solution={})
    for rel, text in (
        ("environment/tool", tool),
        ("solution/helper", "#!/bin/sh\ntr a-z A-Z < greeting.txt > out.txt\n"),
        ("tests/check", '#!/bin/sh\n[ "$(cat /app/out.txt 2>/dev/null)" = HELLO ] && echo 1 || echo 0\n'),
    ):
        (d / rel).write_text(text)
        (d / rel).chmod(0o755)
    env = make_harbor_environment("harbor-exec", [d])
    assert env.harbor_tasks["exec-bits"].executables >= {"environment/tool", "solution/helper", "tests/check"}
    c = await check_task(env, backend, env.build_image(docker_client), "exec-bits")
    assert (c.oracle, c.empty, c.problems) == (1.0, 0.0, [])


async def test_the_oracle_runs_with_the_solutions_env(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    # Harbor's oracle runs solve.sh with [solution] env and DEBIAN_FRONTEND=noninteractive: a task whose solution
    # reads them failed its import here, its oracle scoring 0
    solve = (
        '#!/bin/bash\n[ "$DEBIAN_FRONTEND" = noninteractive ] && printf %s "$ANSWER" > out.txt\n'
        "bash /solution/helper.sh\n"
    )
    d = make_task(tmp_path, "solution-env", solve=solve, toml_extra='[solution]\nenv = { ANSWER = "HELLO" }\n')
    env = make_harbor_environment("harbor-solution-env", [d])
    assert env.harbor_tasks["solution-env"].solution_env == {"ANSWER": "HELLO"}
    c = await check_task(env, backend, env.build_image(docker_client), "solution-env")
    assert (c.oracle, c.empty, c.problems) == (1.0, 0.0, [])


def test_the_workdir_is_the_dockerfiles_last_one_unless_task_toml_names_it(tmp_path: Path) -> None:
    # Harbor runs the agent and test.sh in the image's working directory: here it was /app whatever the Dockerfile
    # said, and a task built in /srv/app found an empty /app
    def workdir(name: str, dockerfile: str, toml_extra: str = "") -> str:
        return load_task(make_task(tmp_path, name, dockerfile=dockerfile, toml_extra=toml_extra)).workdir

    base = "FROM envfleet/base:latest\n"
    assert workdir("abs", base + "WORKDIR /srv/app\nRUN true\n") == "/srv/app"
    assert workdir("rel", base + "WORKDIR /srv\nWORKDIR app/\n") == "/srv/app"
    assert workdir("last", base + "WORKDIR /tmp/build\nRUN true\nWORKDIR /opt/proj\n") == "/opt/proj"
    staged = "FROM envfleet/base:latest AS b\nWORKDIR /build\nFROM envfleet/base:latest\nWORKDIR /x\nFROM b\n"
    assert workdir("staged", staged) == "/build"  # a stage FROM an earlier one starts in its workdir
    assert workdir("none", base + "RUN true\n") == "/app"  # none set: Harbor's usual /app
    assert workdir("named", base + "WORKDIR /srv/app\n", 'workdir = "/opt/w"\n') == "/opt/w"  # task.toml's wins
    # what cannot be read for sure, or cannot be linked to the workspace, is the default (and said)
    for name, line in (
        ("var", "WORKDIR $HOME"),
        ("tmp", "WORKDIR /tmp"),
        ("root", "WORKDIR /"),
        ("up", "WORKDIR /a/../b"),
    ):
        assert workdir(name, base + line + "\n") == "/app", line
    assert workdir("usr-src", base + "WORKDIR /usr/src/app\n") == "/usr/src/app"  # node's images
    assert workdir("var-www", base + "WORKDIR /var/www/\n") == "/var/www"
    # a folder that holds the sandbox's own (moved out of the image whole: the build failed), or the grader's
    # commands and configuration (the agent's `mkdir` in /usr/local/bin ran in the grader), however it is spelled
    for i, arg in enumerate(("/opt", "/usr", "/usr/local/bin", "/etc", "//tmp", "/./tmp", "/opt/./envfleet")):
        assert workdir(f"kept-{i}", f"{base}WORKDIR {arg}\n") == "/app", arg
    assert workdir("dotted", base + "WORKDIR /srv/./app\n") == "/srv/app"
    bad_names = ("/tmp/x", "/workspace/sub", "/logs", "relative", "/opt", "/usr/local/bin", "//workspace", "/./tmp")
    for bad in bad_names:
        with pytest.raises(HarborTaskError, match=r"workdir .* must be an absolute directory path"):
            load_task(
                make_task(tmp_path, "named-" + bad.strip("/").replace("/", "-"), toml_extra=f'workdir = "{bad}"\n')
            )


def test_a_task_without_limits_gets_harbors_defaults(tmp_path: Path) -> None:
    d = make_task(tmp_path, "unlimited")
    (d / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n')
    env = make_harbor_environment("harbor-unlimited", [d])
    assert (env.limits.memory_mb, env.limits.cpus, env.limits.pids) == (2048, 1.0, 1024)
    assert env.episode_timeout_s(env.tasks()[0]) == 600.0  # [agent] timeout_sec's default: the whole run


async def test_the_agent_and_test_sh_run_in_the_dockerfiles_workdir(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    dockerfile = "FROM envfleet/base:latest\nWORKDIR /srv/app\nRUN printf 'hello\\n' > greeting.txt\n"
    solve = "#!/bin/bash\nset -e\ntr a-z A-Z < greeting.txt > out.txt\n"
    test = (
        '#!/bin/bash\nmkdir -p /logs/verifier\nif [ "$(pwd)" = /srv/app ] && [ "$(cat /srv/app/out.txt)" = HELLO ]; '
        "then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    d = make_task(tmp_path, "srv-app", dockerfile=dockerfile, solve=solve, test=test, extra_solution={})
    env = make_harbor_environment("harbor-srv-app", [d])
    c = await check_task(env, backend, env.build_image(docker_client), "srv-app")
    assert (c.oracle, c.empty, c.problems) == (1.0, 0.0, [])
    assert "/srv/app is /workspace" in env.system_prompt


async def test_test_sh_and_solve_sh_run_by_their_own_interpreter_line(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    # Harbor runs the scripts themselves: a test.sh written in Python (its `#!/usr/bin/env python3`) ran under bash
    # here, wrote no reward, and its task failed the import
    test = (
        "#!/usr/bin/env python3\nimport os, pathlib\nout = pathlib.Path('/app/out.txt')\n"
        "ok = out.exists() and out.read_text().strip() == os.environ['EXPECT']\n"
        "pathlib.Path('/logs/verifier').mkdir(parents=True, exist_ok=True)\n"
        "pathlib.Path('/logs/verifier/reward.txt').write_text('1' if ok else '0')\n"
    )
    solve = "#!/usr/bin/env python3\nimport pathlib\npathlib.Path('out.txt').write_text('HELLO')\n"
    d = make_task(tmp_path, "py-scripts", test=test, solve=solve, extra_solution={})
    env = make_harbor_environment("harbor-py-scripts", [d])
    c = await check_task(env, backend, env.build_image(docker_client), "py-scripts")
    assert (c.oracle, c.empty, c.problems) == (1.0, 0.0, [])


def test_the_environment_key_tells_executable_files_apart_and_reads_solution_leniently(tmp_path: Path) -> None:
    # the executable mark was an optional byte beside the next file's name: {a (executable), b} and {a, xb} made
    # one key, and a task whose environment/ differed got another task's image
    def task(name: str, files: dict[str, bool], toml_extra: str = "") -> Path:
        d = make_task(tmp_path, name, toml_extra=toml_extra)
        for rel, executable in files.items():
            (d / "environment" / rel).write_text("x\n")
            (d / "environment" / rel).chmod(0o755 if executable else 0o644)
        return d

    one = load_task(task("one", {"a": True, "b": False}))
    other = load_task(task("other", {"a": False, "xb": False}))
    assert one.environment_key() != other.environment_key()
    # the Dockerfile's own bit never reaches the build: it splits no environment
    same = task("same", {"a": True, "b": False})
    (same / "environment" / "Dockerfile").chmod(0o755)
    assert load_task(same).environment_key() == one.environment_key()
    # [solution] goes only to solve.sh's exec: a value Harbor fills from its host, or a [solution] of another
    # shape, loads as before it was read (it refused the task, and a stored environment with it at the next start)
    lenient = load_task(task("lenient", {}, '[solution]\nenv = { KEY = "${OPENAI_API_KEY}", "bad name" = "x" }\n'))
    assert lenient.solution_env == {"KEY": "${OPENAI_API_KEY}"}
    odd = task("odd", {})
    (odd / "task.toml").write_text('solution = "oops"\n' + (odd / "task.toml").read_text())  # a top-level key
    assert load_task(odd).solution_env == {}
