"""The orchestrator's image, run as an operator would (deploy/run.sh): the installed distribution (entry points,
version), a job end to end through the container, SIGTERM, resuming from the data volume, and health."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest

from orchestrator.cli.config import subcommand_parsers
from orchestrator.cli.main import build_parser
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import ImageBuildError
from orchestrator.core.models import RolloutStatus
from orchestrator.core.sandbox import SandboxSpec
from orchestrator.images.orchestrator_image import ensure_orchestrator_image
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.conftest import REPO, TEST_OWNER, owned_backend
from tests.deploy.conftest import Deployment, docker_cli
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.test_engine_stall import _dockerd_pid

pytestmark = pytest.mark.docker


def test_image_installs_the_distribution(orchestrator_image: str) -> None:
    listing = docker_cli("run", "--rm", orchestrator_image, "envs", "list")
    assert listing.returncode == 0, listing.stderr
    for env in ("python-tool@1", "code-tests@1", "swe@1"):
        assert env in listing.stdout, listing.stdout
    version = docker_cli("run", "--rm", orchestrator_image, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"envfleet {importlib.metadata.version('envfleet')}"
    # the same commands as here, the ones of the envfleet.cli entry point group (the swe plug-in's) included
    usage = docker_cli("run", "--rm", orchestrator_image, "--help")
    choices = re.findall(r"\{([a-z,-]+)\}", usage.stdout)  # --log-format's and the commands'
    assert choices, usage.stdout
    assert set(max(choices, key=len).split(",")) == set(subcommand_parsers(build_parser()))


def _owned_containers(client: docker.DockerClient) -> list[str]:
    found = client.containers.list(ignore_removed=True, all=True, filters={"label": [f"envfleet.owner={TEST_OWNER}"]})
    return [c.name for c in found]


async def test_container_runs_a_job_stops_on_sigterm_and_resumes(
    deployment: Deployment, docker_client: docker.DockerClient
) -> None:
    env = Registry.from_entry_points().get(ENV)
    # on host loopback, which the container shares (--network host); slow enough to stop the server mid-job
    policy = await start_scripted_server(reference_script(env, latency_s=0.3))
    try:
        await asyncio.to_thread(deployment.start)
        ids = [t.id for t in env.tasks()][:8]
        async with EnvfleetClient(deployment.address) as c:
            job_id = await c.submit(job(policy.url, ids, max_concurrency=4))
            rollouts = [r async for r in c.rollouts(job_id, auto_ack=False)]
            assert len(rollouts) == 8
            assert all(r.status == RolloutStatus.OK and r.reward == 1.0 for r in rollouts), [
                (r.status, r.error) for r in rollouts
            ]
            unfinished = await c.submit(job(policy.url, ids, max_concurrency=4))
            for _ in range(300):  # its first rollouts are in their sandboxes when SIGTERM comes
                if (await c.get_job(unfinished)).done >= 1:
                    break
                await asyncio.sleep(0.05)
            assert (await c.get_job(unfinished)).done < 8, "the second job ended before the stop: slow the policy"
            assert _owned_containers(docker_client), "the second job should hold sandboxes now"

        started = time.monotonic()
        stop = await asyncio.to_thread(docker_cli, "stop", "--time", "30", deployment.name)
        took = time.monotonic() - started
        assert stop.returncode == 0, stop.stderr
        state = deployment.state()
        assert state["ExitCode"] == 0, (state, deployment.logs())
        assert took < 25, f"SIGTERM took {took:.1f} s to stop the server (the grace period is 30 s)"
        assert _owned_containers(docker_client) == [], "the container left sandboxes behind"
        records = deployment.log_records()  # every line of the log is a JSON object
        assert any(r["level"] == "INFO" and "orchestrator serving on" in str(r["message"]) for r in records), records

        deployment.remove()
        await asyncio.to_thread(deployment.start)  # a new container on the same data volume
        async with EnvfleetClient(deployment.address) as c:
            again = [r async for r in c.rollouts(job_id, auto_ack=False)]
            assert (await c.get_job(job_id)).done == 8
            resumed = [r async for r in c.rollouts(unfinished, auto_ack=False)]  # finished by the new container
        assert sorted(r.id for r in again) == sorted(r.id for r in rollouts)
        assert len(resumed) == 8
        assert all(r.status == RolloutStatus.OK and r.reward == 1.0 for r in resumed), [
            (r.status, r.error) for r in resumed
        ]
    finally:
        deployment.remove()
        await policy.close()
    assert _owned_containers(docker_client) == []


async def _a_job_holding_sandboxes(
    deployment: Deployment, docker_client: docker.DockerClient, policy_url: str, ids: list[str], held: int
) -> tuple[str, set[str]]:
    """Start the container, submit a job of `ids` at `held` in flight, and wait until it holds that many sandboxes:
    the job's id and their names."""
    await asyncio.to_thread(deployment.start)
    async with EnvfleetClient(deployment.address) as c:
        job_id = await c.submit(job(policy_url, ids, max_concurrency=held))
        for _ in range(600):
            if len(_owned_containers(docker_client)) >= held:
                break
            await asyncio.sleep(0.05)
    names = set(_owned_containers(docker_client))
    assert len(names) >= held, "the job should hold sandboxes now"
    return job_id, names


async def test_a_killed_containers_sandboxes_are_swept_by_the_next_one(
    deployment: Deployment, docker_client: docker.DockerClient
) -> None:
    # killed (SIGKILL, an OOM, a stop past its grace) the server drains nothing: its sandboxes are the next
    # container's to sweep, which must see that their owner is gone (in a pid namespace of its own, it saw another
    # host's owner and kept them until their lease, an hour at least)
    env = Registry.from_entry_points().get(ENV)
    policy = await start_scripted_server(reference_script(env, latency_s=5.0))
    try:
        ids = [t.id for t in env.tasks()][:4]
        _, left = await _a_job_holding_sandboxes(deployment, docker_client, policy.url, ids, 4)
        killed = await asyncio.to_thread(docker_cli, "kill", deployment.name)
        assert killed.returncode == 0, killed.stderr
        await asyncio.to_thread(docker_cli, "rm", "--force", deployment.name)
        assert left <= set(_owned_containers(docker_client)), "the kill itself should leave them"
        await asyncio.to_thread(deployment.start)
        for _ in range(600):
            if not left & set(_owned_containers(docker_client)):
                break
            await asyncio.sleep(0.1)
        assert not left & set(_owned_containers(docker_client)), "the next container kept the killed one's sandboxes"
    finally:
        deployment.remove()
        await policy.close()
    assert _owned_containers(docker_client) == []


async def test_a_server_that_dies_in_its_container_is_started_again_and_finishes_its_job(
    deployment: Deployment, docker_client: docker.DockerClient
) -> None:
    """deploy/run.sh's restart policy (unless-stopped): a server that dies in its container (a crash, the kernel's
    OOM killer) is started again by the engine on the same data volume; it resumes the job, sweeps the sandboxes the
    dead one held, and every rollout is delivered, scored. Without a policy the fleet stayed down until an operator
    came, its sandboxes idle until their lease."""
    env = Registry.from_entry_points().get(ENV)
    policy = await start_scripted_server(reference_script(env, latency_s=1.0))
    try:
        ids = [t.id for t in env.tasks()][:6]
        job_id, held = await _a_job_holding_sandboxes(deployment, docker_client, policy.url, ids, 3)
        top = docker_cli("top", deployment.name, "-eo", "pid,args").stdout.splitlines()[1:]  # host pids (--pid host)
        servers = [line.split()[0] for line in top if " serve " in f"{line} " and "docker-init" not in line]
        assert len(servers) == 1, top
        (server,) = servers
        os.kill(int(server), signal.SIGKILL)
        for _ in range(600):
            if deployment.logs().count("listening") >= 2:
                break
            await asyncio.sleep(0.1)
        restarts = docker_cli("inspect", "--format", "{{.RestartCount}}", deployment.name).stdout.strip()
        assert restarts == "1", (restarts, deployment.state(), deployment.logs()[-3000:])
        async with EnvfleetClient(deployment.address) as c:
            async with asyncio.timeout(120):
                rollouts = [r async for r in c.rollouts(job_id)]
        assert sorted(r.task_id for r in rollouts) == sorted(ids)
        assert all(r.status == RolloutStatus.OK and r.reward == 1.0 for r in rollouts), [
            (r.status, r.error) for r in rollouts
        ]
        assert not held & set(_owned_containers(docker_client)), "the restarted server kept the dead one's sandboxes"
    finally:
        deployment.remove()
        await policy.close()
    assert _owned_containers(docker_client) == []


def _host_probe(address: str) -> str:
    """The image's health probe, run on the host against the container's port."""
    p = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.healthcheck", address, "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        check=False,
    )
    return p.stdout.strip()


async def test_container_turns_healthy_spares_host_sandboxes_and_reports_a_stalled_engine(
    deployment: Deployment, base_image: str
) -> None:
    async with owned_backend() as host_backend:
        # a sandbox of an orchestrator on the host: the container's start-up sweep (same host name under
        # --network host, another pid namespace) must not take its owner for dead
        host_sandbox = await host_backend.create(SandboxSpec(image=base_image))
        try:
            await asyncio.to_thread(deployment.start)
            deadline = time.monotonic() + 90
            while (health := deployment.health()).get("Status") != "healthy":
                assert time.monotonic() < deadline, f"not healthy: {health}"
                await asyncio.sleep(1)
            assert (await host_sandbox.exec(["echo", "alive"])).stdout == b"alive\n"
        finally:
            await host_sandbox.close()
    assert await asyncio.to_thread(_host_probe, deployment.address) == "SERVING"
    await asyncio.to_thread(_probe_while_the_engine_is_stopped, deployment.address)


def _probe_while_the_engine_is_stopped(address: str) -> None:
    # the engine paused (SIGSTOP): as short as the test allows, since it stops every container call on this host
    pid = _dockerd_pid()
    seen = []
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            seen.append(_host_probe(address))
            if seen[-1] == "NOT_SERVING":
                break
            time.sleep(0.25)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert seen[-1] == "NOT_SERVING", f"the probe saw {seen} while the engine was stopped"

    deadline = time.monotonic() + 15
    while (status := _host_probe(address)) != "SERVING":
        assert time.monotonic() < deadline, f"the server did not recover: {status}"
        time.sleep(0.25)


PLUGIN_PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "envfleet-demo-plugin"
version = "0.3.0"

[project.entry-points."envfleet.environments"]
demo-plugin = "envfleet_demo_plugin:DemoEnv"
"""
PLUGIN_MODULE = '''
"""A plug-in environment from its own wheel."""

from environments.python_tool import PythonToolEnv


class DemoEnv(PythonToolEnv):
    """python-tool under another name."""

    name = "demo-plugin"
'''


def test_extra_wheels_add_plugin_environments(
    docker_client: docker.DockerClient, base_image: str, tmp_path: Path
) -> None:
    src = tmp_path / "plugin"
    (src / "envfleet_demo_plugin").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    (src / "envfleet_demo_plugin" / "__init__.py").write_text(PLUGIN_MODULE)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels)]
    subprocess.run([*pip, str(src)], check=True, capture_output=True, timeout=120)

    tag = ensure_orchestrator_image(docker_client, extra_wheels=wheels)
    try:
        listing = docker_cli("run", "--rm", tag, "envs", "list")
        assert listing.returncode == 0, listing.stderr
        assert "demo-plugin@1" in listing.stdout and "python-tool@1" in listing.stdout, listing.stdout
    finally:
        docker_client.images.remove(tag)
    with pytest.raises(ImageBuildError, match=r"holds no \*\.whl"):
        ensure_orchestrator_image(docker_client, extra_wheels=src)
