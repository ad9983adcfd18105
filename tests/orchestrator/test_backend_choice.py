"""`envfleet serve --backend docker|fake` does what it says: a fake server runs jobs end to end without any engine
(and resumes after a SIGKILL without loss), its latencies show in the rollouts' timings, a bad backend config is
refused with the problem named, and docker stays docker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import docker
import pydantic
import pytest

from orchestrator.backends.config import DockerBackendConfig, FakeBackendConfig
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.backends.docker.sweeper import LABEL_OWNER
from orchestrator.backends.fake import FakeBackend
from orchestrator.cli.main import _server_config, build_parser
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import ConfigError
from orchestrator.server.app import OrchestratorConfig
from orchestrator.service.registry import Registry
from orchestrator.service.store import ResultStore
from orchestrator.testing.policy_script import Script, Step
from orchestrator.testing.scripted_policy import ScriptedServer, start_scripted_server
from orchestrator.testing.scripts import reference_script
from protos import orchestrator_pb2 as pb
from tests.conftest import REPO, TEST_OWNER
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, serve, until_done

SERVE = (sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0")
NO_ENGINE = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}  # any engine call would fail


async def _serve_cli(data: Path, *args: str, group: bool = False) -> tuple[subprocess.Popen[str], str]:
    """`envfleet serve` as a subprocess with no reachable Docker engine (`group`: leading a process group of its
    own, as a shell's foreground job does); returns it and its address."""
    proc = subprocess.Popen(
        [*SERVE, "--metrics-port", "-1", "--data-dir", str(data), "--owner", TEST_OWNER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=NO_ENGINE,
        start_new_session=group,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
    if not line.startswith("listening "):
        proc.kill()
        proc.wait()
        raise AssertionError(f"serve did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc, line.split()[1]


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)


async def test_serve_backend_fake_runs_jobs_end_to_end_and_survives_sigkill(
    tmp_path: Path, policy_server: ScriptedServer, registry: Registry
) -> None:
    config = tmp_path / "fake.yaml"
    config.write_text("exec_latency_s: 0.01\nrules:\n  - {match: '^never$', stdout: unused}\n")
    args = ("--backend", "fake", "--backend-config", str(config))
    data = tmp_path / "data"
    tasks = registry.get(ENV).tasks()[:6]
    slow_policy = await start_scripted_server(reference_script(registry.get(ENV), latency_s=0.25))
    proc, address = await _serve_cli(data, *args)
    try:
        async with EnvfleetClient(address) as c:
            job_id = await c.submit(job(policy_server.url, [t.id for t in tasks[:4]], n=2))
            rollouts = [r async for r in c.rollouts(job_id)]
            info = await c.get_job(job_id)
            assert info.state == "COMPLETED" and info.done == 8
            # a second job, killed mid-way with the server
            slow_job = await c.submit(job(slow_policy.url, [t.id for t in tasks], max_concurrency=2))
            done_before = await until_done(c, slow_job, 2, timeout_s=30, poll_s=0.05)
        assert 2 <= done_before < len(tasks)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc, address = await _serve_cli(data, *args)
        async with EnvfleetClient(address) as c:
            resumed = [r async for r in c.rollouts(slow_job)]
            slow_info = await c.get_job(slow_job)
    finally:
        _stop(proc)
        await slow_policy.close()
    assert proc.returncode == 0

    assert sorted((r.task_id, r.sample_index) for r in rollouts) == sorted((t.id, i) for t in tasks[:4] for i in (0, 1))
    # python-tool scores the submitted answer only, so the scripted policy's reference answers score 1 even here
    assert {r.status for r in rollouts} == {"OK"} and {r.reward for r in rollouts} == {1.0}
    for r in rollouts:
        code = next(t for t in tasks if t.id == r.task_id).reference[0].arguments["code"]
        # the python tool ran nothing: the fake echoed the code it was given on stdin
        assert next(t.text for t in r.turns if t.role == "tool") == code
        assert r.provenance.image == "envfleet/base:latest"

    # the restarted server resumed the killed job from its result log: nothing lost, nothing redone
    assert slow_info.state == "COMPLETED" and slow_info.done == len(tasks)
    assert sorted(r.task_id for r in resumed) == sorted(t.id for t in tasks) and {r.reward for r in resumed} == {1.0}
    store = await ResultStore.open(data / "results.sqlite3")
    try:
        assert len(await store.done_ids(slow_job)) == len(tasks)
    finally:
        await store.close()


async def test_ctrl_c_stops_serve_and_its_workers_without_restarting_them(tmp_path: Path, task_ids: list[str]) -> None:
    # Ctrl-C reaches a terminal's whole foreground process group: the workers, in serve's group, stopped on their own
    # SIGINT, and their supervisors, not stopping yet (serve gives an open stream its grace first), started every one
    # again while serve shut down
    slow = await start_scripted_server(Script(default=[Step(content="thinking")], latency_s=60))
    proc, address = await _serve_cli(tmp_path / "data", "--backend", "fake", "--workers", "2", group=True)
    try:
        async with EnvfleetClient(address) as c:
            job_id = await c.submit(job(slow.url, task_ids[:2]))
            for _ in range(200):  # the workers are up, with its rollouts
                if (await c.get_job(job_id)).in_flight == 2:
                    break
                await asyncio.sleep(0.05)
            stream = asyncio.ensure_future(anext(c.rollout_messages(job_id)))  # held open through the stop
            os.killpg(proc.pid, signal.SIGINT)
            _, err = await asyncio.to_thread(proc.communicate, timeout=60)
            stream.cancel()
    finally:
        _stop(proc)
        await slow.close()
    assert "starting it again" not in err, err[-3000:]


async def test_fake_latencies_show_in_the_rollout_timings(
    tmp_path: Path, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    slow = FakeBackendConfig(owner=TEST_OWNER, create_latency_s=0.6, exec_latency_s=0.4)
    async with serve(tmp_path, backend=slow, pool={"enabled": False}) as orch, EnvfleetClient(orch.address) as c:
        [r] = [r async for r in c.rollouts(await c.submit(job(policy_server.url, task_ids[:1])))]
    assert r.status == "OK"
    assert 0.6 <= r.timing.sandbox_acquire < 5, r.timing  # a cold create
    assert 0.4 <= r.timing.tools < 5, r.timing  # one python call


async def test_bad_backend_configs_are_refused_with_the_problem_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("create_latency_s: -1\nexec_latncy_s: 2\n")
    r = await asyncio.to_thread(
        subprocess.run,
        [*SERVE, "--data-dir", str(tmp_path), "--backend", "fake", "--backend-config", str(bad)],
        cwd=REPO,
        env=NO_ENGINE,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.strip() == (
        "envfleet serve: invalid backend config: create_latency_s: Input should be greater than or equal to 0; "
        "exec_latncy_s: Extra inputs are not permitted"
    )
    assert not (tmp_path / "results.sqlite3").exists(), "a refused config opens nothing"

    not_a_mapping = tmp_path / "list.yaml"
    not_a_mapping.write_text("- 1\n")
    cases = [
        (["--backend", "docker", "--backend-config", str(bad)], "create_latency_s: Extra inputs are not permitted"),
        (["--backend", "fake", "--backend-config", str(tmp_path / "missing.yaml")], "No such file"),
        (["--backend", "fake", "--backend-config", str(not_a_mapping)], "expected a mapping of settings"),
    ]
    for args, message in cases:
        with pytest.raises(ConfigError, match=message):
            _server_config(build_parser().parse_args(["serve", *args]))
    fake_as_docker = tmp_path / "typed.yaml"
    fake_as_docker.write_text("type: fake\n")
    with pytest.raises(ConfigError, match="backend config says type 'fake' but --backend is 'docker'"):
        _server_config(build_parser().parse_args(["serve", "--backend-config", str(fake_as_docker)]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--backend", "kubernetes"])
    with pytest.raises(pydantic.ValidationError, match=r"backend\.fake\.exec_latency_s"):
        OrchestratorConfig.model_validate({"backend": {"type": "fake", "exec_latency_s": "soon"}})
    with pytest.raises(pydantic.ValidationError, match="does not match any of the expected tags: 'docker', 'fake'"):
        OrchestratorConfig.model_validate({"backend": {"type": "kubernetes"}})


def test_the_backend_flag_chooses_the_config() -> None:
    def backend_of(*argv: str) -> object:
        config = _server_config(build_parser().parse_args(["serve", "--owner", "me", *argv]))
        assert isinstance(config, OrchestratorConfig)
        return config.backend

    docker_config = backend_of()
    assert isinstance(docker_config, DockerBackendConfig) and docker_config.owner == "me"
    fake_config = backend_of("--backend", "fake")
    assert isinstance(fake_config, FakeBackendConfig) and fake_config.owner == "me"
    assert json.loads(OrchestratorConfig(backend=FAKE).model_dump_json())["backend"]["type"] == "fake"


async def test_fake_orchestrator_runs_on_the_fake_backend(tmp_path: Path) -> None:
    async with serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as c:
        assert isinstance(orch.backend, FakeBackend)
        box = await c.sandbox_stub.Create(pb.CreateSandboxRequest(image="envfleet/base:latest"))
        assert [s.labels[LABEL_OWNER] for s in await orch.backend.list_owned()] == [TEST_OWNER]
        await c.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=box.sandbox_id))


@pytest.mark.docker
async def test_backend_docker_still_uses_docker(
    tmp_path: Path, base_image: str, docker_client: docker.DockerClient
) -> None:
    async with serve(tmp_path) as orch, EnvfleetClient(orch.address) as c:
        assert isinstance(orch.backend, DockerBackend)
        box = await c.sandbox_stub.Create(pb.CreateSandboxRequest(image=base_image))
        [sandbox] = [s for s in await orch.backend.list_owned()]
        container = await asyncio.to_thread(docker_client.containers.get, sandbox.id)
        assert container.labels[LABEL_OWNER] == TEST_OWNER and container.status == "running"
        await c.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=box.sandbox_id))


async def test_a_data_directory_serves_one_server_at_a_time(tmp_path: Path) -> None:
    # two servers on one data directory both resumed its unfinished jobs (each rollout run twice) and wrote one
    # result log; the second is refused with the holder named, and a killed holder's lock goes with it
    data = tmp_path / "data"
    first, _ = await _serve_cli(data, "--backend", "fake", "--workers", "0")
    try:
        second = subprocess.run(
            [*SERVE, "--metrics-port", "-1", "--data-dir", str(data), "--backend", "fake", "--workers", "0"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=NO_ENGINE,
            timeout=60,
        )
        assert second.returncode != 0 and "listening" not in second.stdout
        assert f"data directory {data} is in use by another envfleet server (pid {first.pid})" in second.stderr
        assert "Traceback" not in second.stderr
        with pytest.raises(ConfigError, match="in use by another envfleet server"):  # in a process of its own too
            async with serve(data, backend=FAKE):
                pass
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        again, _ = await _serve_cli(data, "--backend", "fake", "--workers", "0")
        _stop(again)
        assert again.returncode == 0
    finally:
        _stop(first)
    async with serve(data, backend=FAKE):  # each stop let go of it
        pass
    async with serve(data, backend=FAKE):
        pass


async def test_a_stop_whose_early_stage_fails_still_lets_go_of_the_data_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stage of the stop that raised (the health service's, the viewer's) skipped the rest: the backend's close,
    # the result log's, and the data directory's lock, which then refused the next server in this process
    from grpc_health.v1 import health

    async def broken(self: object) -> None:
        raise RuntimeError("the health service failed")

    data = tmp_path / "data"
    monkeypatch.setattr(health.aio.HealthServicer, "enter_graceful_shutdown", broken)
    async with serve(data, backend=FAKE):
        pass
    monkeypatch.undo()
    async with serve(data, backend=FAKE):  # the lock was let go, and the log closed
        pass
