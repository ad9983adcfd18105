"""A Harbor task's verifier runs clean, and the Dockerfile checked is the Dockerfile built.

- tests/test.sh runs with the grader's environment (orchestrator.core.environment.GRADER_ENV): a usercustomize.py
  the agent planted in its user site (under a writable HOME) does not run in the verifier's pythons, and a task's
  [verifier] env cannot turn that back on.
- The image is the task's Dockerfile with envfleet's lines appended; a last line that continues (ends in the escape
  character) joined them to the task's instruction, so `ADD <url> \\` passed the check with the URL as its
  destination and was built with it as a source, fetched by the daemon on the host network.
- A verifier that fails after the agent's turn (here: held past its timeout by the agent's program) scores 0 once
  the task is validated, never an ENV_ERROR the agent could trade its 0 for.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import docker
import grpc
import pytest

import orchestrator.core.sandbox as sandbox_module
from environments.harbor.archive import HarborKind
from environments.harbor.env import (
    VERIFIER_FAILED_METRIC,
    VERIFIER_RERUN_METRIC,
    built_dockerfile,
    make_harbor_environment,
)
from environments.harbor.task import HarborRewardError, HarborTaskError
from environments.harbor.validate import validate
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.core.environment import Episode, Score
from orchestrator.core.errors import SandboxError
from orchestrator.core.sandbox import DETERMINISTIC_ENV, SandboxSpec
from tests.environments.harbor.test_harbor import DOCKERFILE, TOML, make_task
from tests.security.test_builds import Canary, canary  # noqa: F401  (the fixture)
from tests.security.test_harbor_archives import TOKEN_A, _members, _refused, _tar, _upload

# the verifier's verdict is a python's exit status, as in most test.sh files (pytest's)
TEST_SH = """#!/bin/bash
if python3 -c 'import sys; sys.exit(1)'; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
# the agent's move: a usercustomize.py in its user site that makes every python exit 0 at start
PLANT = """#!/bin/bash
set -e
site=$(python3 -c 'import site; print(site.getusersitepackages())')
mkdir -p "$site"
printf 'import os\\nos._exit(0)\\n' > "$site/usercustomize.py"
"""


async def _score_after_the_agent(
    tmp_path: Path,
    backend: DockerBackend,
    docker_client: docker.DockerClient,
    name: str,
    test: str,
    solve: str,
    planted: list[str],
    verifier_env: str = 'HOME = "/tmp"',
    planted_cwd: str | None = None,
) -> Score:
    """The score of a task whose agent (its solve.sh) ran first, under a writable HOME, as many tasks need (the
    sandbox's uid has no account, so Docker's HOME is the read-only /); `planted`: a command that shows the agent's
    move took effect in the sandbox."""
    d = make_task(tmp_path, name, test=test, solve=solve, toml_extra=f"env = {{ {verifier_env} }}\n")
    env = make_harbor_environment(f"harbor-{name}", [d])
    image = await asyncio.to_thread(env.build_image, docker_client)
    task = env.tasks()[0]
    async with await backend.create(SandboxSpec(image=image, limits=env.limits, env=dict(DETERMINISTIC_ENV))) as s:
        await env.setup(s, task, 0)
        solved = await env.run_solution(s, task.id)
        assert solved is not None and solved.ok, solved
        assert (await s.exec(planted, cwd=planted_cwd)).exit_code == 0, "the agent's move did not take effect"
        return await env.score(s, task, Episode([], "", "submit"))


async def test_the_verifier_does_not_run_a_planted_usercustomize(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    # the plant works: any python the agent starts exits 0 at once
    works = ["python3", "-c", "import sys; sys.exit(1)"]
    score = await _score_after_the_agent(tmp_path, backend, docker_client, "planted", TEST_SH, PLANT, works)
    assert score.reward == 0.0


# a test.sh whose tools keep a cache in HOME (uv, go, npm, cargo do), and that must not see what the agent left there
CACHING_TEST_SH = """#!/bin/bash
if mkdir -p "$HOME/.cache/tool" && [ ! -e "$HOME/.gitconfig" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
PLANT_GITCONFIG = """#!/bin/bash
printf '[core]\\n\\tfsmonitor = /tmp/forge\\n' > "$HOME/.gitconfig"
"""


async def test_the_verifier_gets_a_writable_home_the_agent_never_had(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    # HOME=/nonexistent made a right solution's test.sh fail at its first cache write (reward 0); the agent's own
    # writable HOME held its ~/.gitconfig, which git in test.sh would have run
    planted = ["cat", "/tmp/.gitconfig"]
    score = await _score_after_the_agent(
        tmp_path, backend, docker_client, "home", CACHING_TEST_SH, PLANT_GITCONFIG, planted
    )
    assert score.reward == 1.0


# the agent's move: a ~/.gitconfig in a HOME that is its workspace, which it then makes read-only
PLANT_GITCONFIG_AND_LOCK = """#!/bin/bash
printf '[core]\\n\\tfsmonitor = /app/forge\\n' > "$HOME/.gitconfig" && chmod 555 /workspace
"""


async def test_a_home_the_agent_controlled_is_not_the_verifiers_even_made_read_only(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    # the verifier's HOME was judged by its write bit: HOME=/app is the workdir's link to /workspace, which the agent
    # owns, and after a chmod 555 it was "never the agent's", so git in test.sh would run the agent's fsmonitor
    planted = ["/bin/sh", "-c", "test -f /app/.gitconfig && ! test -w /app"]
    score = await _score_after_the_agent(
        tmp_path,
        backend,
        docker_client,
        "home-locked",
        CACHING_TEST_SH,
        PLANT_GITCONFIG_AND_LOCK,
        planted,
        verifier_env='HOME = "/app"',
    )
    assert score.reward == 1.0


# the agent's move: a `bash` in a folder of the verifier's PATH under the workdir (uv's /app/.venv/bin), which
# writes the reward itself
PLANT_BASH = """#!/bin/bash
mkdir -p /app/.venv/bin
printf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' > /app/.venv/bin/bash
chmod 755 /app/.venv/bin/bash
"""


async def test_the_graders_own_commands_are_never_the_agents(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    # the grader ran test.sh with a bare `bash`, found on the task's PATH: the agent's, which wrote reward 1
    planted = ["/bin/sh", "-c", "test -x /app/.venv/bin/bash"]
    env = 'HOME = "/tmp", PATH = "/app/.venv/bin:/usr/local/bin:/usr/bin:/bin"'
    score = await _score_after_the_agent(
        tmp_path, backend, docker_client, "path", TEST_SH, PLANT_BASH, planted, verifier_env=env
    )
    assert score.reward == 0.0


# the agent's move: fill /tmp, where /tests and /logs live, to its last block and inode
FILL_TMP = """#!/bin/bash
dd if=/dev/zero of=/tmp/fill bs=64k 2>/dev/null
for i in $(seq 1 100000); do : > /tmp/f$i 2>/dev/null || break; done
exit 0
"""


async def test_an_agent_that_fills_tmp_scores_0_never_a_masked_env_error(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    # the tests' upload (or test.sh's reward file) failed on the full /tmp: ENV_ERROR, a rollout masked from
    # training, so an agent about to fail could trade its 0 for no signal at all
    full = ["/bin/sh", "-c", "! dd if=/dev/zero of=/tmp/probe bs=64k count=1 2>/dev/null"]
    score = await _score_after_the_agent(tmp_path, backend, docker_client, "filled", TEST_SH, FILL_TMP, full)
    assert score.reward == 0.0 and score.metrics == {"agent_filled_tmp": 1.0}, score


def test_a_verifier_env_cannot_undo_the_clean_grader(tmp_path: Path) -> None:
    for name, value in (("PYTHONNOUSERSITE", ""), ("PYTHONDONTWRITEBYTECODE", "")):
        d = make_task(tmp_path, f"undo-{name.lower()}")
        toml = TOML.format(verifier_timeout=60).replace('EXPECT = "HELLO"', f'EXPECT = "HELLO", {name} = "{value}"')
        (d / "task.toml").write_text(toml)
        with pytest.raises(HarborTaskError, match=rf"\[verifier\] env {name}: .*the verifier runs with"):
            make_harbor_environment("undo", [d])


async def test_a_dockerfile_whose_last_line_continues_is_refused(
    tmp_path: Path,
    base_image: str,
    docker_client: docker.DockerClient,
    canary: Canary,  # noqa: F811
) -> None:
    dockerfile = DOCKERFILE + f"ADD {canary.url}/harbor-tail \\\n"
    d = make_task(tmp_path, "continued", dockerfile=dockerfile)
    message = r"environment/Dockerfile: .*last instruction \(line 4\),? continues past the end of the file"
    with pytest.raises(HarborTaskError, match=message):
        # what it did: the check passed, and the build fetched the URL (the tail's first line its destination)
        env = make_harbor_environment("continued", [d])
        await asyncio.to_thread(env.build_image, docker_client)
    assert canary.requests == []


def test_the_dockerfile_built_is_the_dockerfile_checked(tmp_path: Path) -> None:
    # load_task checks the task's own text; the text built (with the tail) is checked again, whole, right before
    # the build: a task that got past the first check (as one did, with the old parser) stops here
    task = make_harbor_environment("built", [make_task(tmp_path, "built")]).harbor_tasks["built"]
    assert task.dockerfile is not None
    for extra, message in (
        ("ADD http://127.0.0.1:9/x \\\n", r"the lines envfleet appends would join its last instruction \(line 4\)"),
        ("ADD http://127.0.0.1:9/x /x\n", r"line 4: ADD .*: the daemon would fetch it on the host network"),
    ):
        with pytest.raises(HarborTaskError, match=rf"task built: environment/Dockerfile: {message}"):
            built_dockerfile(dataclasses.replace(task, dockerfile=task.dockerfile + extra))


async def test_an_uploaded_dockerfile_whose_last_line_continues_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens.yaml"
    token_file.write_text(f"tokens:\n  {TOKEN_A}: team-a\n")
    bad = make_task(tmp_path / "src", "bad-task", dockerfile=DOCKERFILE + "ADD http://127.0.0.1:9/x \\\n")
    details = await _refused(
        tmp_path, token_file, _upload(_tar(list(_members(bad)))), grpc.StatusCode.INVALID_ARGUMENT, "continues past"
    )
    assert "task bad-task: environment/Dockerfile" in details, details


# a verdict from a program the agent writes: the oracle's prints 42, an empty solution has none (0), and an agent's
# that never ends holds test.sh past its timeout, so it writes no reward
VERDICT_SH = """#!/bin/bash
if [ "$(timeout 60 python3 answer.py 2>/dev/null)" = 42 ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
ORACLE = "#!/bin/bash\necho 'print(42)' > answer.py\n"
HANG = "#!/bin/bash\necho 'while True: pass' > answer.py\n"


async def test_a_verifier_the_agent_hung_scores_0_once_the_task_is_validated(
    tmp_path: Path,
    base_image: str,
    backend: DockerBackend,
    docker_client: docker.DockerClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # test.sh ran past its timeout because of the agent's code: ENV_ERROR, masked from training, so an agent about
    # to fail could trade its 0 for no signal by leaving a program that never ends. A validated task's test.sh
    # wrote a reward in time for the oracle and for an empty solution: when it does not after an agent's turn, the
    # agent's doing is why, and it scores 0. An unvalidated task (import-harbor --no-validate) is not known to work.
    d = make_task(tmp_path, "hang", test=VERDICT_SH, solve=ORACLE, verifier_timeout=3)
    env = make_harbor_environment("harbor-hang", [d])
    image = await asyncio.to_thread(env.build_image, docker_client)
    [check] = await validate(env, backend, image)
    assert (check.oracle, check.empty, check.problems) == (1.0, 0.0, []), check
    task = env.tasks()[0]

    async def score_after_the_hang() -> Score:
        async with await backend.create(SandboxSpec(image=image, limits=env.limits)) as s:
            await env.setup(s, task, 0)
            assert (await s.exec(["bash", "-c", HANG], cwd="/app")).ok
            return await env.score(s, task, Episode([], "", "submit"))

    with pytest.raises(HarborRewardError, match=r"timed out after 3s"):
        await score_after_the_hang()
    HarborKind().validated(env)  # what the server does with a registered archive, import-harbor with a validated one
    assert env.validated and not make_harbor_environment("harbor-hang", [d]).validated
    score = await score_after_the_hang()
    assert score.reward == 0.0 and score.metrics == {VERIFIER_FAILED_METRIC: 1.0}, score
    # ... unless the sandbox cannot run a shell that does nothing in time: then the host is why, INFRA_ERROR
    monkeypatch.setattr(sandbox_module, "PROBE_SLOW_S", 0.0)  # any time at all is too slow
    with pytest.raises(SandboxError, match="the host, not the policy, is slow"):
        await score_after_the_hang()


async def test_a_validated_verifier_a_busy_host_held_past_its_timeout_runs_again(
    tmp_path: Path, base_image: str, backend: DockerBackend, docker_client: docker.DockerClient
) -> None:
    # the host, not the agent, held test.sh past its timeout: the sandbox frozen for longer than it, as a host too
    # busy to run it would leave it. The agent's answer is right; a 0 for the host's doing would be an
    # infrastructure failure passed off as a reward. test.sh runs once more, and its verdict stands.
    slow = VERDICT_SH.replace("\n", "\nsleep 1\n", 1)  # long enough to be seen running
    d = make_task(tmp_path, "slow-host", test=slow, solve=ORACLE, verifier_timeout=3)
    env = make_harbor_environment("harbor-slow-host", [d])
    HarborKind().validated(env)
    image = await asyncio.to_thread(env.build_image, docker_client)
    task = env.tasks()[0]
    frozen: list[float] = []

    async def freeze_the_first_verifier(container_id: str) -> None:
        container = await asyncio.to_thread(docker_client.containers.get, container_id)
        while True:
            top = await asyncio.to_thread(container.top, ps_args="-eo pid,args")
            if any("/tests/test.sh" in " ".join(p) for p in top.get("Processes") or []):
                await asyncio.to_thread(container.pause)
                try:
                    await asyncio.sleep(4.5)
                finally:
                    await asyncio.to_thread(container.unpause)
                frozen.append(4.5)
                return
            await asyncio.sleep(0.02)

    async with await backend.create(SandboxSpec(image=image, limits=env.limits)) as s:
        await env.setup(s, task, 0)
        assert (await s.exec(["bash", "-c", ORACLE], cwd="/app")).ok
        freezer = asyncio.create_task(freeze_the_first_verifier(s.id))
        try:
            score = await env.score(s, task, Episode([], "", "submit"))
        finally:
            freezer.cancel()
            await asyncio.gather(freezer, return_exceptions=True)
    assert frozen, "the verifier was never seen running"
    assert score.reward == 1.0 and score.metrics.get(VERIFIER_RERUN_METRIC) == 1.0, score


async def test_a_reward_file_over_the_cap_is_no_reward(tmp_path: Path) -> None:
    # it was read up to the cap and parsed: "1", a megabyte of blanks, then "0" scored 1 (Harbor reads it whole)
    class Sandbox:
        async def read_file(self, path: str, max_bytes: int) -> bytes:
            return (b"1" + b" " * (1 << 20) + b"0")[:max_bytes]

    env = make_harbor_environment("big-reward", [make_task(tmp_path, "big-reward")])
    with pytest.raises(HarborRewardError, match=r"reward\.txt is over"):
        await env._read(Sandbox(), "/logs/verifier/reward.txt")  # type: ignore[arg-type]


def test_the_workdir_the_agent_writes_is_never_where_the_grader_finds_its_commands(tmp_path: Path) -> None:
    # the workdir becomes a link to /workspace, the agent's: a Dockerfile's `WORKDIR /usr/local/bin` (first on the
    # grader's PATH), `/etc` (ld.so.preload) or `/opt` (envd's folder, moved out whole) gave the agent the grader's
    # commands, libraries or daemon; spelled `/./usr/local/bin` or `//etc`, it passed the first version of the check
    from environments.harbor.task import load_task

    base = "FROM envfleet/base:latest\n"
    for i, workdir in enumerate(("/usr/local/bin", "/./usr/local/bin", "//etc", "/etc/x", "/opt", "/usr", "/lib64")):
        task = load_task(make_task(tmp_path, f"wd-{i}", dockerfile=f"{base}WORKDIR {workdir}\n"))
        assert task.workdir == "/app", workdir
        with pytest.raises(HarborTaskError, match="workdir"):
            load_task(make_task(tmp_path, f"named-{i}", toml_extra=f'workdir = "{workdir}"\n'))


LOCK_OUT = """#!/bin/bash
chmod 000 /workspace /tmp/harbor/logs
exit 0
"""
# a link to its own folder where the logs go, hidden under a /tmp/harbor nobody may look into: a look for links
# made before the folder was opened again missed it, and the reward was written (and refused) through it
HIDDEN_LINK = """#!/bin/bash
rm -rf /tmp/harbor/logs && mkdir /workspace/l && ln -s /workspace/l /tmp/harbor/logs && chmod 000 /tmp/harbor
exit 0
"""


@pytest.mark.parametrize(
    ("solve", "planted"),
    [
        (LOCK_OUT, "! ls /workspace && ! ls /tmp/harbor/logs"),
        (HIDDEN_LINK, "! ls /tmp/harbor"),
    ],
    ids=["modes", "link-under-a-locked-folder"],
)
async def test_an_agent_that_locks_the_grader_out_of_its_paths_scores_0_never_a_masked_env_error(
    tmp_path: Path,
    base_image: str,
    backend: DockerBackend,
    docker_client: docker.DockerClient,
    solve: str,
    planted: str,
) -> None:
    # the grader runs as the agent's uid, where Harbor's verifier is root: a `chmod 000` of the workspace (envd's
    # default cwd, and test.sh's workdir) or of the logs failed each step of the grader's, an ENV_ERROR (masked)
    # the agent chose over its 0 for a task not validated
    locked = ["/bin/sh", "-c", planted]
    score = await _score_after_the_agent(
        tmp_path, backend, docker_client, "locked", TEST_SH, solve, locked, planted_cwd="/"
    )
    assert score.reward == 0.0 and score.metrics == {"test_exit_code": 0.0}, score  # test.sh ran and said 0
