"""SandboxService over real gRPC and real containers: lifecycle, streamed exec, files, limits, the TTL, and a
container that died underneath."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import docker
import grpc
import pytest

from orchestrator.backends.config import DockerBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.sandbox import SANDBOX_UIDS
from orchestrator.server.app import Orchestrator
from protos import orchestrator_pb2 as pb
from tests.orchestrator.servers import expect_error, serve


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def _exec(client: EnvfleetClient, sid: str, **kw: object) -> list[pb.ExecEvent]:
    return [ev async for ev in client.sandbox_stub.Exec(pb.ExecRequest(sandbox_id=sid, **kw))]  # type: ignore[arg-type]


async def test_lifecycle_exec_files_and_hardening(
    client: EnvfleetClient, base_image: str, docker_client: docker.DockerClient
) -> None:
    stub = client.sandbox_stub
    info = await stub.Create(pb.CreateSandboxRequest(image=base_image, limits=pb.SandboxLimits(memory_mb=256, pids=64)))
    sid = info.sandbox_id
    assert (
        info.state == pb.SANDBOX_STATE_RUNNING
        and info.state_name == "RUNNING"
        and info.limits.memory_mb == 256
        and info.limits.pids == 64
    )
    assert info.expires_at > info.created_at

    events = await _exec(client, sid, shell="for i in 1 2 3; do echo $i; sleep 0.05; done; echo oops >&2; exit 3")
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-1] == "ended" and "stdout" in kinds and "stderr" in kinds
    assert b"".join(e.stdout for e in events) == b"1\n2\n3\n" and b"".join(e.stderr for e in events) == b"oops\n"
    assert events[-1].ended.exit_code == 3

    # the same hardening as every sandbox: a uid of its own, read-only root, no network, no capabilities, the limits
    out = b"".join(e.stdout for e in await _exec(client, sid, shell="id -u; touch /probe 2>/dev/null || echo ro"))
    uid, ro = out.decode().split()
    assert int(uid) in SANDBOX_UIDS and ro == "ro"
    (c,) = await asyncio.to_thread(docker_client.api.containers, filters={"label": [f"envfleet.sandbox={sid}"]})
    host = (await asyncio.to_thread(docker_client.api.inspect_container, c["Id"]))["HostConfig"]
    assert (host["Memory"], host["PidsLimit"], host["NetworkMode"]) == (256 << 20, 64, "none")
    assert host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]

    (ended,) = [
        e.ended
        for e in await _exec(client, sid, argv=pb.Argv(args=["sleep", "30"]), timeout_s=0.5)
        if e.HasField("ended")
    ]
    assert ended.timed_out
    events = await _exec(client, sid, shell="yes | head -c 100000", max_output_bytes=1000)
    assert events[-1].ended.truncated and sum(len(e.stdout) for e in events) <= 1000

    await stub.WriteFile(pb.SandboxWriteFileRequest(sandbox_id=sid, path="notes/a.txt", content=b"hello"))
    got = await stub.ReadFile(pb.SandboxReadFileRequest(sandbox_id=sid, path="/workspace/notes/a.txt"))
    assert got.content == b"hello" and not got.truncated
    # a file past max_bytes says so: its first bytes, read as the whole file, were a reward it did not hold
    for cap, content, truncated in ((3, b"hel", True), (5, b"hello", False)):
        got = await stub.ReadFile(pb.SandboxReadFileRequest(sandbox_id=sid, path="notes/a.txt", max_bytes=cap))
        assert (got.content, got.truncated) == (content, truncated), cap
    await expect_error(
        stub.ReadFile(pb.SandboxReadFileRequest(sandbox_id=sid, path="missing")), grpc.StatusCode.NOT_FOUND
    )
    up = await stub.Upload(
        pb.SandboxUploadRequest(sandbox_id=sid, dest_dir="up", tar=_tar({"x.txt": b"x", "y.txt": b"yy"}))
    )
    assert up.files == 2
    down = await stub.Download(pb.SandboxDownloadRequest(sandbox_id=sid, path="up"))
    with tarfile.open(fileobj=io.BytesIO(down.tar)) as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == ["up/x.txt", "up/y.txt"]

    assert [s.sandbox_id for s in (await stub.List(pb.ListSandboxesRequest())).sandboxes] == [sid]
    await stub.Delete(pb.DeleteSandboxRequest(sandbox_id=sid))
    await expect_error(stub.Get(pb.GetSandboxRequest(sandbox_id=sid)), grpc.StatusCode.NOT_FOUND, "deleted")
    listed = (await stub.List(pb.ListSandboxesRequest())).sandboxes
    assert [(s.sandbox_id, s.state) for s in listed] == [(sid, pb.SANDBOX_STATE_DELETED)]


async def test_bad_creates(client: EnvfleetClient, base_image: str) -> None:
    stub = client.sandbox_stub
    cases = [
        (pb.CreateSandboxRequest(image=base_image, limits=pb.SandboxLimits(memory_mb=0)), "limits.memory_mb"),
        (pb.CreateSandboxRequest(image=base_image, limits=pb.SandboxLimits(pids=-1)), "limits.pids"),
        (pb.CreateSandboxRequest(image=base_image, ttl_s=1e12), "ttl_s"),
        (pb.CreateSandboxRequest(image=base_image, env_vars={"A=B": "x"}), "env_vars"),
        (pb.CreateSandboxRequest(image=base_image, env_vars={"A\n": "x"}), "env_vars"),  # `$` let it through
        # past what execve takes, each was UNAVAILABLE (the sandbox's start failed with E2BIG), which clients retry:
        # a string over MAX_ARG_STRLEN, one within 128 Ki characters but not bytes, and too many bytes in all
        (pb.CreateSandboxRequest(image=base_image, env_vars={"A": "x" * (128 << 10)}), "the kernel's limit"),
        (pb.CreateSandboxRequest(image=base_image, env_vars={"A": "\u00e9" * (64 << 10)}), "the kernel's limit"),
        (
            pb.CreateSandboxRequest(image=base_image, env_vars={f"V{i}": "x" * 100_000 for i in range(11)}),
            "over 786432",
        ),
        (pb.CreateSandboxRequest(image="alpine:latest"), "only envfleet images"),
        (pb.CreateSandboxRequest(), "exactly one of image and env"),
    ]
    for request, fragment in cases:
        await expect_error(stub.Create(request), grpc.StatusCode.INVALID_ARGUMENT, fragment)
    await expect_error(
        stub.Create(pb.CreateSandboxRequest(image="envfleet/nope:1")), grpc.StatusCode.NOT_FOUND, "not on this host"
    )
    await expect_error(stub.Create(pb.CreateSandboxRequest(env="nope")), grpc.StatusCode.NOT_FOUND, "no environment")


async def test_variables_at_the_kernels_limits_start_a_sandbox(client: EnvfleetClient, base_image: str) -> None:
    # the caps are the kernel's, not below them: strings of MAX_ARG_STRLEN with its NUL, the sandbox's and the
    # exec's variables each near their budget, and all of it in one execve
    stub = client.sandbox_stub
    longest = "x" * ((128 << 10) - len("V0=") - 1)
    info = await stub.Create(
        pb.CreateSandboxRequest(image=base_image, env_vars={f"V{i}": longest for i in range(5)} | {"W": "y" * 50_000})
    )
    more = {f"E{i}": longest for i in range(5)}
    events = await _exec(client, info.sandbox_id, shell="printenv V4 | wc -c; printenv W | wc -c", env=more)
    assert b"".join(e.stdout for e in events).split() == [str(len(longest) + 1).encode(), b"50001"]
    await stub.Delete(pb.DeleteSandboxRequest(sandbox_id=info.sandbox_id))


async def test_ttl_destroys_and_owner_sees_it(
    tmp_path: Path, base_image: str, docker_client: docker.DockerClient
) -> None:
    async with serve(tmp_path, sandboxes={"reap_interval_s": 0.2}) as orch, EnvfleetClient(orch.address) as client:
        stub = client.sandbox_stub
        info = await stub.Create(pb.CreateSandboxRequest(env="python-tool", ttl_s=1.0))
        sid = info.sandbox_id
        assert info.env == "python-tool" and info.image.startswith("envfleet/base")
        flt = {"label": [f"envfleet.sandbox={sid}"]}
        assert len(await asyncio.to_thread(docker_client.api.containers, filters=flt)) == 1
        await asyncio.sleep(1.6)
        assert await asyncio.to_thread(docker_client.api.containers, all=True, filters=flt) == []
        listed = (await stub.List(pb.ListSandboxesRequest())).sandboxes
        assert [(s.sandbox_id, s.state, s.end_reason) for s in listed] == [
            (sid, pb.SANDBOX_STATE_EXPIRED, "its ttl ended")
        ]
        await expect_error(stub.Get(pb.GetSandboxRequest(sandbox_id=sid)), grpc.StatusCode.NOT_FOUND, "expired at")
        await expect_error(
            stub.Exec(pb.ExecRequest(sandbox_id=sid, shell="true")), grpc.StatusCode.NOT_FOUND, "expired"
        )


def _socket_dir(orch: Orchestrator, name: str) -> Path:
    backend = orch.config.backend
    assert isinstance(backend, DockerBackendConfig)
    return backend.socket_root / name


async def _kill_container(docker_client: docker.DockerClient, orch: Orchestrator, sid: str) -> str:
    """`docker kill` a raw sandbox's container, as an operator, the OOM killer or a dockerd restart would; its name."""
    (c,) = await asyncio.to_thread(docker_client.api.containers, filters={"label": [f"envfleet.sandbox={sid}"]})
    name = str(c["Names"][0]).lstrip("/")
    assert _socket_dir(orch, name).is_dir()  # what must go with it
    await asyncio.to_thread(docker_client.api.kill, c["Id"])
    return name


async def _nothing_left(docker_client: docker.DockerClient, orch: Orchestrator, sid: str, name: str) -> None:
    """No container of the sandbox, stopped or not, and no socket folder of it under the socket root, once the
    removal that ending it started is through (List shows it ended as soon as that removal starts)."""
    flt = {"label": [f"envfleet.sandbox={sid}"]}
    left: tuple[list[object], bool] = ([], False)
    for _ in range(50):
        containers = await asyncio.to_thread(docker_client.api.containers, all=True, filters=flt)
        left = (containers, _socket_dir(orch, name).exists())
        if left == ([], False):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"left of sandbox {sid} after 5 s (containers, socket folder): {left}")


async def test_a_call_that_finds_the_container_dead_ends_the_sandbox_and_gives_its_room_back(
    tmp_path: Path, base_image: str, docker_client: docker.DockerClient
) -> None:
    # one sandbox fills both the tenant's quota and the host's capacity: the next create tells whether both came back
    async with (
        serve(tmp_path, sandboxes={"max_per_tenant": 1}, capacity={"max_sandboxes": 1}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        stub = client.sandbox_stub
        sid = (await stub.Create(pb.CreateSandboxRequest(image=base_image))).sandbox_id
        await expect_error(
            stub.Create(pb.CreateSandboxRequest(image=base_image)), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_per_tenant"
        )
        name = await _kill_container(docker_client, orch, sid)

        # the call that finds it dead says so, and so does every later one: not UNAVAILABLE (retrying cannot help)
        await expect_error(
            stub.Exec(pb.ExecRequest(sandbox_id=sid, shell="true")), grpc.StatusCode.NOT_FOUND, f"sandbox {sid} died"
        )
        await expect_error(
            stub.ReadFile(pb.SandboxReadFileRequest(sandbox_id=sid, path="a")), grpc.StatusCode.NOT_FOUND, "died at"
        )
        await expect_error(stub.Get(pb.GetSandboxRequest(sandbox_id=sid)), grpc.StatusCode.NOT_FOUND, "container")
        (listed,) = (await stub.List(pb.ListSandboxesRequest())).sandboxes
        assert (listed.sandbox_id, listed.state, listed.state_name) == (sid, pb.SANDBOX_STATE_DIED, "DIED")
        assert "its container" in listed.end_reason and "exit code 137" in listed.end_reason, listed.end_reason
        assert listed.ended_at >= listed.created_at

        assert orch.jobs.scheduler.reserved == 0
        await _nothing_left(docker_client, orch, sid, name)
        again = await stub.Create(pb.CreateSandboxRequest(image=base_image))
        ended = [e.ended.exit_code for e in await _exec(client, again.sandbox_id, shell="true") if e.HasField("ended")]
        assert ended == [0]
        await stub.Delete(pb.DeleteSandboxRequest(sandbox_id=again.sandbox_id))


async def test_the_reaper_ends_a_sandbox_whose_container_died_and_spares_the_live_one(
    tmp_path: Path, base_image: str, docker_client: docker.DockerClient
) -> None:
    config = {"reap_interval_s": 0.2, "probe_interval_s": 0.5}
    async with serve(tmp_path, sandboxes=config) as orch, EnvfleetClient(orch.address) as client:
        stub = client.sandbox_stub
        dead = (await stub.Create(pb.CreateSandboxRequest(image=base_image))).sandbox_id
        live = (await stub.Create(pb.CreateSandboxRequest(image=base_image))).sandbox_id
        assert orch.jobs.scheduler.reserved == 2
        name = await _kill_container(docker_client, orch, dead)

        # nobody calls it: only the reaper can notice
        states: dict[str, tuple[int, str]] = {}
        for _ in range(50):
            await asyncio.sleep(0.1)
            states = {
                s.sandbox_id: (s.state, s.end_reason) for s in (await stub.List(pb.ListSandboxesRequest())).sandboxes
            }
            if states[dead][0] != pb.SANDBOX_STATE_RUNNING:
                break
        assert states[dead][0] == pb.SANDBOX_STATE_DIED and "its container" in states[dead][1], states
        assert states[live] == (pb.SANDBOX_STATE_RUNNING, "")
        assert orch.jobs.scheduler.reserved == 1
        await _nothing_left(docker_client, orch, dead, name)
        await expect_error(
            stub.Exec(pb.ExecRequest(sandbox_id=dead, shell="true")), grpc.StatusCode.NOT_FOUND, f"sandbox {dead} died"
        )

        # probed every 0.5 s meanwhile, the live one is still RUNNING and works
        await asyncio.sleep(1.0)
        assert (await stub.Get(pb.GetSandboxRequest(sandbox_id=live))).state == pb.SANDBOX_STATE_RUNNING
        events = await _exec(client, live, shell="echo ok")
        assert b"".join(e.stdout for e in events) == b"ok\n"
        await stub.Delete(pb.DeleteSandboxRequest(sandbox_id=live))


async def test_a_sandboxs_ttl_runs_on_the_monotonic_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # on the wall clock, a clock set an hour on (NTP, a VM resumed) destroyed every tenant's sandbox at the next
    # reap, an hour early; one set back kept them, and their quota, an hour past their ttl
    import time

    from tests.orchestrator.servers import FAKE

    async with (
        serve(tmp_path, backend=FAKE, sandboxes={"reap_interval_s": 0.1}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        stub = client.sandbox_stub
        sid = (await stub.Create(pb.CreateSandboxRequest(env="python-tool", ttl_s=60))).sandbox_id
        short = (await stub.Create(pb.CreateSandboxRequest(env="python-tool", ttl_s=1))).sandbox_id
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() + 3600)
        await asyncio.sleep(1.5)
        assert (await stub.Get(pb.GetSandboxRequest(sandbox_id=sid))).state == pb.SANDBOX_STATE_RUNNING
        monkeypatch.setattr(time, "time", lambda: wall() - 3600)
        await expect_error(stub.Get(pb.GetSandboxRequest(sandbox_id=short)), grpc.StatusCode.NOT_FOUND, "expired")


async def test_a_list_does_not_wait_on_the_removal_of_sandboxes_that_expired(tmp_path: Path) -> None:
    # List reaped first, removing each expired sandbox (any tenant's) one after another before it answered: one
    # tenant's many short-lived sandboxes held every List of every tenant for seconds each
    import time

    from orchestrator.backends.config import FakeBackendConfig
    from tests.conftest import TEST_OWNER

    slow = FakeBackendConfig(owner=TEST_OWNER, destroy_latency_s=1.0)
    async with (
        serve(tmp_path, backend=slow, sandboxes={"reap_interval_s": 3600}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        stub = client.sandbox_stub
        ids = [(await stub.Create(pb.CreateSandboxRequest(env="python-tool", ttl_s=1))).sandbox_id for _ in range(10)]
        await asyncio.sleep(1.2)
        t0 = time.monotonic()
        listed = {s.sandbox_id: s.state for s in (await stub.List(pb.ListSandboxesRequest())).sandboxes}
        took = time.monotonic() - t0
        assert listed == dict.fromkeys(ids, pb.SANDBOX_STATE_EXPIRED)
        assert took < 5.0, f"List waited {took:.1f}s on the removals (10 of 1 s each)"
        assert orch.jobs.scheduler.reserved == 0  # their room came back at once
