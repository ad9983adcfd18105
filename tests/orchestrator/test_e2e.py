"""End to end over real gRPC: submit, stream, ack; rewards, statuses, groups and exact tokens. What the job manager
and the runner decide (groups, tokens, acks, failure classes, retries) runs on the fake backend; what real sandboxes
do (a container killed from outside, sandboxes gone on cancel) on real Docker."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import ClassVar

import docker
import grpc
import pytest

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.backends.fake import FakeBackend
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Environment, Rubric, ScoringContext, Task
from orchestrator.core.models import Rollout, RolloutStatus
from orchestrator.core.sandbox import Sandbox
from orchestrator.server.app import Orchestrator
from orchestrator.service.registry import Registry
from orchestrator.testing import toy_tokenizer as toy
from orchestrator.testing.scripted_policy import Script, ScriptedServer, Step, start_scripted_server
from orchestrator.testing.scripts import reference_script
from protos import orchestrator_pb2 as pb
from tests.conftest import TEST_OWNER
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import local_runner, serve, until_done


async def test_job_streams_scored_groups_with_exact_tokens(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str], registry: Registry
) -> None:
    client = fake_client
    ids = task_ids[:3]
    job_id = await client.submit(job(policy_server.url, ids, n=2, deliver_groups=True))
    groups = [g async for g in client.groups(job_id)]
    assert sorted(g.task_id for g in groups) == sorted(ids)
    env = registry.get(ENV)
    for g in groups:
        assert len(g.rollouts) == 2 and g.failed == 0
        assert sorted(r.sample_index for r in g.rollouts) == [0, 1]
        assert g.advantages == [pytest.approx(0.0), pytest.approx(0.0)]  # equal rewards: no advantage
        for r in g.rollouts:
            assert r.status == RolloutStatus.OK and r.reward == 1.0, r.error
            assert r.reward_components == {"exact_match": 1.0}
            assert r.metrics["used_python"] == 1.0
            assert r.policy_version == "v1" and r.attempts == 1
            assert r.provenance.image.startswith("envfleet/base:") and r.provenance.image_id.startswith("sha256:")
            # tokens: exactly what the (toy) server tokenized, observation tokens masked out
            task = next(t for t in env.tasks() if t.id == r.task_id)
            t = r.tokens
            assert t.status == "complete"
            assert t.prompt_ids == toy.prompt_ids(env.messages(task))
            assert len(t.completion_ids) == len(t.completion_mask) == len(t.completion_logprobs)
            policy_positions = [i for i, m in enumerate(t.completion_mask) if m == 1]
            assert 0 < len(policy_positions) < len(t.completion_ids)  # there are observation tokens in between
            assert all(t.completion_logprobs[i] == 0.0 for i, m in enumerate(t.completion_mask) if m == 0)
            assert all(t.completion_logprobs[i] < 0 for i in policy_positions)
            # the first completion is the tokenization of the first assistant message, with its logprobs
            first = [tid for tid, m in zip(t.completion_ids, t.completion_mask, strict=True)][: len(policy_positions)]
            assert first[-1] == toy.END or toy.END in t.completion_ids
    info = await client.get_job(job_id)
    assert info.state == "COMPLETED" and info.done == 6 and info.acked == 6
    assert dict(info.by_status) == {"OK": 6}


async def test_wrong_answers_score_zero_and_stay_ok(
    client: EnvfleetClient, task_ids: list[str], registry: Registry
) -> None:
    server = await start_scripted_server(reference_script(registry.get(ENV), mode="wrong"))
    try:
        job_id = await client.submit(job(server.url, task_ids[:2]))
        rollouts = [r async for r in client.rollouts(job_id)]
    finally:
        await server.close()
    assert [r.status for r in rollouts] == [RolloutStatus.OK, RolloutStatus.OK]
    assert [r.reward for r in rollouts] == [0.0, 0.0]


async def test_policy_errors_and_hangs_are_never_rewards(fake_client: EnvfleetClient, task_ids: list[str]) -> None:
    client = fake_client  # the runner's classification: no sandbox behaviour involved
    a, b = task_ids[:2]
    script = Script(tasks={a: [Step(error_status=500)], b: [Step(hang=True)]})
    server = await start_scripted_server(script)
    try:
        spec = job(server.url, [a], rollout_timeout_s=60)
        spec = spec.model_copy(update={"policy": spec.policy.model_copy(update={"max_retries": 1})})
        job_a = await client.submit(spec)
        job_b = await client.submit(job(server.url, [b], rollout_timeout_s=1))
        (ra,) = [r async for r in client.rollouts(job_a)]
        (rb,) = [r async for r in client.rollouts(job_b)]
    finally:
        await server.close()
    assert ra.status == RolloutStatus.POLICY_ERROR and ra.reward is None
    assert ra.error is not None and "500" in ra.error.message
    assert rb.status == RolloutStatus.TIMEOUT and rb.reward is None
    assert rb.error is not None and "exceeded 1s" in rb.error.message


async def test_a_policy_server_restarted_mid_job_delays_its_rollouts_and_fails_none(
    fake_client: EnvfleetClient, registry: Registry, task_ids: list[str]
) -> None:
    """A trainer's inference server restarting mid-job (it answers what it holds 503, refuses connections for a
    while, then serves again): every rollout in flight, and each one started meanwhile, was a POLICY_ERROR once its
    few retries were spent, the job's queue drained into masked samples. Now they wait for it (outage_wait_s) and
    are scored as if nothing happened, the wait not taken from their episodes' time."""
    client = fake_client  # the policy seam: no sandbox behaviour involved
    script = reference_script(registry.get(ENV), latency_s=0.3)
    server = await start_scripted_server(script)
    port, url = server.port, server.url
    ids = task_ids[:4]
    # an episode of 6 s and its rollout's 8 s are shorter than the outage and the retries' backoff: only the wait's
    # not counting as the policy's time lets an episode caught in it finish
    spec = job(url, ids, n=2, max_concurrency=4, rollout_timeout_s=8)
    spec = spec.model_copy(update={"policy": spec.policy.model_copy(update={"max_retries": 1, "outage_wait_s": 60})})
    restarted: ScriptedServer | None = None
    try:
        job_id = await client.submit(spec)
        for _ in range(1500):  # rollouts in flight, some waiting for an answer
            if server.requests >= 6:
                break
            await asyncio.sleep(0.02)
        await server.close()  # what it holds is answered 503; then nothing listens
        await asyncio.sleep(5.0)
        restarted = await start_scripted_server(script, port=port)
        rollouts = [r async for r in client.rollouts(job_id)]
    finally:
        await server.close()
        if restarted is not None:
            await restarted.close()
    assert len(rollouts) == 8
    failed = [(r.id, r.status, r.error) for r in rollouts if r.status != RolloutStatus.OK or r.reward != 1.0]
    assert not failed, failed
    assert all(r.attempts == 1 for r in rollouts)
    assert restarted.requests > 0 and sum(1 for r in rollouts if r.timing.total > 5.0) >= 4  # the outage held them
    assert max(r.metrics["policy_outage_s"] for r in rollouts) > 2.0  # and they say how long


async def test_a_policy_server_down_for_good_is_a_policy_error_once_the_wait_is_spent(
    fake_client: EnvfleetClient, registry: Registry, task_ids: list[str]
) -> None:
    """Waiting out a server down has an end: the rollout's outage_wait_s, for all its requests together. Then it is
    POLICY_ERROR, masked, saying so; never a TIMEOUT of the policy's, never a reward."""
    server = await start_scripted_server(reference_script(registry.get(ENV)))
    url = server.url
    await server.close()
    spec = job(url, task_ids[:1], rollout_timeout_s=60)
    spec = spec.model_copy(update={"policy": spec.policy.model_copy(update={"max_retries": 1, "outage_wait_s": 1.5})})
    (r,) = [r async for r in fake_client.rollouts(await fake_client.submit(spec))]
    assert r.status == RolloutStatus.POLICY_ERROR and r.reward is None and r.attempts == 1
    assert r.error is not None and "outage_wait_s (1.5s)" in r.error.message, r.error
    assert r.timing.total < 30


async def _sandbox_of(orchestrator: Orchestrator, rollout_id: str, avoid: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    """The container id of a running rollout's sandbox (waits for it)."""
    for _ in range(400):
        sb = local_runner(orchestrator).active.get(rollout_id)
        if sb is not None and sb.id not in avoid:
            return sb.id
        await asyncio.sleep(0.025)
    raise AssertionError(f"rollout {rollout_id} never got a sandbox")


async def test_container_killed_from_outside_is_infra_error_then_retried(
    client: EnvfleetClient,
    registry: Registry,
    task_ids: list[str],
    docker_client: docker.DockerClient,
    orchestrator: Orchestrator,
) -> None:
    script = reference_script(registry.get(ENV), mode="solve", latency_s=1.5)
    server = await start_scripted_server(script)
    try:
        job_id = await client.submit(job(server.url, task_ids[:1], max_infra_retries=2))
        victim = await _sandbox_of(orchestrator, f"{job_id}:{task_ids[0]}:0")
        await asyncio.sleep(0.3)
        docker_client.api.kill(victim)
        (r,) = [r async for r in client.rollouts(job_id)]
    finally:
        await server.close()
    assert r.status == RolloutStatus.OK and r.reward == 1.0
    assert r.attempts == 2


async def test_a_sandbox_killed_mid_rollout_is_retried_on_a_fresh_one_on_the_fake_backend(
    fake_client: EnvfleetClient, fake_orchestrator: Orchestrator, registry: Registry, task_ids: list[str]
) -> None:
    backend = fake_orchestrator.backend
    assert isinstance(backend, FakeBackend)
    server = await start_scripted_server(reference_script(registry.get(ENV), latency_s=0.3))
    try:
        retried = await fake_client.submit(job(server.url, task_ids[:1], max_infra_retries=1))
        backend.kill(await _sandbox_of(fake_orchestrator, f"{retried}:{task_ids[0]}:0"))
        (ok,) = [r async for r in fake_client.rollouts(retried)]
        no_budget = await fake_client.submit(job(server.url, task_ids[1:2], max_infra_retries=0))
        backend.kill(await _sandbox_of(fake_orchestrator, f"{no_budget}:{task_ids[1]}:0"))
        (failed,) = [r async for r in fake_client.rollouts(no_budget)]
    finally:
        await server.close()
    assert (ok.status, ok.reward, ok.attempts) == (RolloutStatus.OK, 1.0, 2)
    assert (failed.status, failed.reward, failed.attempts) == (RolloutStatus.INFRA_ERROR, None, 1)
    assert failed.error is not None and failed.error.kind == "SandboxDiedError", failed.error


async def test_infra_error_after_the_retry_budget_is_not_a_reward(
    client: EnvfleetClient,
    registry: Registry,
    task_ids: list[str],
    docker_client: docker.DockerClient,
    orchestrator: Orchestrator,
) -> None:
    script = reference_script(registry.get(ENV), mode="solve", latency_s=1.0)
    server = await start_scripted_server(script)
    killed: set[str] = set()
    try:
        job_id = await client.submit(job(server.url, task_ids[:1], max_infra_retries=0))
        stream = client.rollouts(job_id)

        async def first() -> Rollout:
            return await anext(stream)

        collector = asyncio.create_task(first())
        while not collector.done():
            sb = local_runner(orchestrator).active.get(f"{job_id}:{task_ids[0]}:0")
            if sb is not None and sb.id not in killed:
                killed.add(sb.id)
                await asyncio.sleep(0.2)
                with contextlib.suppress(docker.errors.APIError):
                    docker_client.api.kill(sb.id)
            await asyncio.sleep(0.02)
        r = collector.result()
        await stream.aclose()  # type: ignore[attr-defined]
    finally:
        await server.close()
    assert r.status == RolloutStatus.INFRA_ERROR and r.reward is None and r.attempts == 1
    # killed while starting or while running: either way a sandbox error, never a score
    assert r.error is not None and r.error.kind in ("SandboxDiedError", "SandboxCreateError"), r.error


async def test_update_policy_and_cancel(
    client: EnvfleetClient,
    registry: Registry,
    task_ids: list[str],
    docker_client: docker.DockerClient,
    orchestrator: Orchestrator,
) -> None:
    server = await start_scripted_server(reference_script(registry.get(ENV), latency_s=0.5))
    try:
        job_id = await client.submit(job(server.url, task_ids[:12], max_concurrency=2))
        status = await client.update_policy(job_id, "v2")
        assert status.policy_version == "v2"
        await until_done(client, job_id, 4, timeout_s=30)
        running = {sb.id for rid, sb in local_runner(orchestrator).active.items() if rid.startswith(job_id)}
        assert running, "rollouts should be running when the job is cancelled"
        cancelled = await client.cancel_job(job_id)
        assert cancelled.state == "CANCELLED"
        # cancelling returns once the running rollouts' sandboxes are destroyed
        assert not running & {c["Id"] for c in docker_client.api.containers(all=True)}
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.update_policy(job_id, "v3")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        done = [r async for r in client.rollouts(job_id)]
        # each rollout records the version it started with: only the first two began before the update
        versions = [r.policy_version for r in done]
        assert versions.count("v1") <= 2 and versions.count("v2") >= 2, versions
        assert len(done) < 12
    finally:
        await server.close()


async def test_environment_service(fake_client: EnvfleetClient) -> None:
    client = fake_client
    envs = await client.list_envs()
    assert ENV in [e.name for e in envs]
    info = await client.describe_env(ENV)
    assert info.version == "1" and info.num_tasks >= 50 and [t.name for t in info.tools] == ["python", "submit"]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.describe_env("pyhton-tool")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "did you mean python-tool" in (e.value.details() or "")


async def test_owner_label_is_the_test_suites(orchestrator: Orchestrator) -> None:
    assert isinstance(orchestrator.backend, DockerBackend) and orchestrator.backend.config.owner == TEST_OWNER
    assert pb.RolloutStatus.Name(pb.ROLLOUT_STATUS_OK) == "ROLLOUT_STATUS_OK"


async def test_a_policy_version_update_keeps_the_endpoints_client() -> None:
    # a trainer calls UpdatePolicy at every step: a client (its HTTP pools and sockets) per version, never closed,
    # ran a long job's server out of file descriptors
    from orchestrator.backends.fake import FakeBackend
    from orchestrator.backends.pool import SandboxPool
    from orchestrator.core.policy import PolicyEndpoint
    from orchestrator.rollout.runner import RolloutRunner
    from orchestrator.service.executor import LocalExecutor
    from tests.orchestrator.servers import FAKE

    backend = FakeBackend(FAKE)
    executor = LocalExecutor(RolloutRunner(SandboxPool(backend), backend.images))
    endpoint = PolicyEndpoint(base_url="http://127.0.0.1:9/v1", version="v1")
    first = executor.policy(endpoint)
    assert all(executor.policy(endpoint.model_copy(update={"version": f"v{i}"})) is first for i in range(2, 50))
    assert executor.policy(endpoint.model_copy(update={"model": "other"})) is not first  # another endpoint
    await executor.close()
    await backend.close()


async def test_a_rollout_out_of_time_before_it_had_a_sandbox_is_infrastructure_not_a_timeout(
    tmp_path: Path, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    # TIMEOUT is the episode's (a trainer may penalise a slow policy for it); a fleet too slow to hand out a sandbox
    # within the rollout's time is the fleet's: INFRA_ERROR, retried within the job's budget, never a reward
    slow = FakeBackendConfig(owner=TEST_OWNER, create_latency_s=3.0)
    async with serve(tmp_path / "data", backend=slow) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(job(policy_server.url, [task_ids[0]], rollout_timeout_s=0.5, max_infra_retries=0))
        async with asyncio.timeout(30):
            (r,) = [r async for r in client.rollouts(job_id)]
    assert (r.status, r.reward, r.attempts) == (RolloutStatus.INFRA_ERROR, None, 1), r
    assert r.error is not None and r.error.kind == "SandboxWaitTimeoutError", r.error
    assert "no sandbox within the rollout's 0.5s" in r.error.message


async def _never(ctx: ScoringContext) -> float:
    return 0.0


class _SetupHangs(Environment):
    """An environment whose setup outlasts the rollout: on a slow host, a copy of a big repository does."""

    name: ClassVar[str] = "setup-hangs"
    rubric: ClassVar[Rubric] = Rubric([("never", _never, 1.0)])

    def tasks(self) -> list[Task]:
        return [Task(id="t", prompt="p")]

    async def setup(self, sandbox: Sandbox, task: Task, seed: int) -> None:
        await asyncio.sleep(30)


@pytest.mark.parametrize(
    ("exec_latency_s", "status", "kind", "attempts"),
    [
        (0.0, RolloutStatus.ENV_ERROR, "EnvironmentBroken", 1),  # the sandbox keeps time: the setup is stuck
        (3.0, RolloutStatus.INFRA_ERROR, "SandboxUnavailableError", 2),  # a do-nothing shell is slow: the host
    ],
    ids=["environment", "host"],
)
async def test_a_rollout_out_of_time_in_its_setup_is_the_environments_or_the_hosts_never_a_timeout(
    tmp_path: Path,
    policy_server: ScriptedServer,
    exec_latency_s: float,
    status: RolloutStatus,
    kind: str,
    attempts: int,
) -> None:
    # a setup cut by the rollout's deadline was TIMEOUT, the episode's outcome, before any episode began: a look at
    # the host's pace says whose it is (retried when it is the host's)
    registry = Registry()
    registry.register(_SetupHangs())
    fake = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=exec_latency_s)
    async with serve(tmp_path / "data", registry, backend=fake) as orch, EnvfleetClient(orch.address) as client:
        spec = job(policy_server.url, ["t"], rollout_timeout_s=0.5, max_infra_retries=1)
        job_id = await client.submit(spec.model_copy(update={"env": "setup-hangs"}))
        async with asyncio.timeout(60):
            (r,) = [r async for r in client.rollouts(job_id)]
    assert (r.status, r.reward, r.attempts) == (status, None, attempts), r
    assert r.error is not None and r.error.kind == kind, r.error
    assert "the environment's setup did not end within the rollout's 0.5s" in r.error.message


@pytest.mark.parametrize("room", [False, True])
async def test_an_image_this_host_lacks_is_infrastructure_not_the_environments(
    tmp_path: Path, task_ids: list[str], monkeypatch: pytest.MonkeyPatch, room: bool
) -> None:
    # builds never pull: a Ray node without the base image the control plane's host had made each rollout placed
    # there ENV_ERROR (never retried, the environment blamed), where the same rollouts ran on the control plane. And
    # an image removed under disk pressure is built again, which the disk's floor may refuse: the host's state too
    import time

    from orchestrator.core.errors import BuildRoomError, ImageNotOnHostError
    from orchestrator.core.policy import PolicyEndpoint
    from orchestrator.rollout.policy.client import OpenAIPolicy
    from orchestrator.rollout.runner import WorkItem
    from tests.orchestrator.servers import FAKE

    async def missing(env: object) -> tuple[str, str]:
        if room:
            raise BuildRoomError("the engine's disk has 6144 MB free: a build that may write 10240 MB would leave")
        raise ImageNotOnHostError("the Dockerfile reads 'envfleet/base:latest', which is not an image on this host")

    async with serve(tmp_path / "data", backend=FAKE) as orch:
        runner = local_runner(orch)
        monkeypatch.setattr(runner.images, "resolve", missing)
        env = orch.jobs.registry.get(ENV)
        item = WorkItem("direct", next(t for t in env.tasks() if t.id == task_ids[0]), 0, time.monotonic())
        policy = OpenAIPolicy(PolicyEndpoint(base_url="http://127.0.0.1:9/v1"))
        try:
            r = await runner.run(
                item, env, job("http://127.0.0.1:9/v1", task_ids[:1], max_infra_retries=1), policy, "v1"
            )
        finally:
            await policy.aclose()
    assert (r.status, r.reward, r.attempts) == (RolloutStatus.INFRA_ERROR, None, 2), r
    assert r.error is not None and "this host cannot build the image of python-tool@1" in r.error.message


async def test_a_rollouts_end_comes_after_its_start_whatever_the_wall_clock_does(
    tmp_path: Path, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # both ends were read off the wall clock: set back an hour during the rollout (NTP, a VM resumed), the rollout
    # ended an hour before it began, against the contract's finished_at >= started_at
    import time
    import types

    from orchestrator.core.policy import REPLAY_URL
    from orchestrator.rollout import runner as runner_module
    from orchestrator.rollout.policy.replay import ReplayPolicy
    from orchestrator.rollout.runner import WorkItem
    from tests.orchestrator.servers import FAKE

    readings = iter([0.0])  # the first reading is the start; every later one is an hour behind

    def jumping() -> float:
        return time.time() - 3600 * (next(readings, None) is None)

    monkeypatch.setattr(runner_module, "time", types.SimpleNamespace(time=jumping, monotonic=time.monotonic))
    async with serve(tmp_path / "data", backend=FAKE) as orch:
        env = orch.jobs.registry.get(ENV)
        item = WorkItem("direct", next(t for t in env.tasks() if t.id == task_ids[0]), 0, time.monotonic())
        r = await local_runner(orch).run(item, env, job(REPLAY_URL, task_ids[:1]), ReplayPolicy(env), "v1")
    assert r.status == RolloutStatus.OK, r.error
    assert 0 <= r.finished_at - r.started_at < 60, (r.started_at, r.finished_at)
