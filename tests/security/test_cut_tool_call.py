"""A tool call cut by the episode's deadline leaves nothing of the policy's running when the grader starts. It was
cancelled there, and envd killed the command (and what it started) only once it noticed the cancel: scoring began at
once, and a process the command had started could watch for the grader's and read its input (a code-tests case and
its expected value) in that window, or mark itself as the grader's so that the cut command's kill spared it. The
call now gets the time left as its own timeout, so envd stops it, and all it started, before it answers. That window
is milliseconds, and this test does not hit it on the old code: it holds the new path to its promise, a command
stopped at the deadline with a process of its own session left running nothing (test_episode_time.py shows the
call now ends by its timeout). On real Docker, with the scripted policy over HTTP."""

from __future__ import annotations

import asyncio

from orchestrator.backends.docker import DockerBackend
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.core.sandbox import SandboxSpec
from orchestrator.rollout.episode import run_episode
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step, start_scripted_server
from tests.orchestrator.conftest import ENV

# a process of its own session, writing on, then a command that outlasts the episode
LINGERS = (
    "import subprocess, time\n"
    "subprocess.Popen(['sh', '-c', 'while :; do echo x >> /tmp/alive; sleep 0.05; done'], start_new_session=True)\n"
    "time.sleep(120)\n"
)


async def test_a_call_cut_at_the_deadline_has_ended_with_all_it_started_before_the_episode_does(
    backend: DockerBackend, base_image: str
) -> None:
    env = Registry.from_entry_points().get(ENV)
    step = Step(tool_calls=[ScriptedToolCall(name="python", arguments={"code": LINGERS})])
    async with (
        await start_scripted_server(Script(default=[step] * 8), tokens=False) as scripted,
        await backend.create(SandboxSpec(image=base_image)) as sandbox,
    ):
        policy = OpenAIPolicy(PolicyEndpoint(base_url=scripted.url, request_timeout_s=30, max_retries=0))
        try:
            deadline = asyncio.get_running_loop().time() + 3.0
            result = await run_episode(
                env, env.tasks()[0], sandbox, policy, Sampling(), 8, "r", [], deadline=deadline, cut_by=deadline + 10
            )
        finally:
            await policy.aclose()
        assert result.episode.finish == "time"
        # at once, as the grader would start: nothing writes any more
        r = await sandbox.exec(["sh", "-c", "wc -c < /tmp/alive; sleep 0.5; wc -c < /tmp/alive"])
        before, after = r.stdout.split()
        assert int(before) > 0 and before == after, "a process of the cut call runs on"
