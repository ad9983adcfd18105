"""SandboxService over real gRPC and real containers: lifecycle, streamed exec, files, limits, and the TTL."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import docker
import grpc

from orchestrator.client.sdk import EnvfleetClient
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

    # the same hardening as every sandbox: uid 100000, read-only root, no network, no capabilities, the limits
    out = b"".join(e.stdout for e in await _exec(client, sid, shell="id -u; touch /probe 2>/dev/null || echo ro"))
    assert out.decode().split() == ["100000", "ro"]
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
    assert got.content == b"hello"
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
        (pb.CreateSandboxRequest(image="alpine:latest"), "only envfleet images"),
        (pb.CreateSandboxRequest(), "exactly one of image and env"),
    ]
    for request, fragment in cases:
        await expect_error(stub.Create(request), grpc.StatusCode.INVALID_ARGUMENT, fragment)
    await expect_error(
        stub.Create(pb.CreateSandboxRequest(image="envfleet/nope:1")), grpc.StatusCode.NOT_FOUND, "not on this host"
    )
    await expect_error(stub.Create(pb.CreateSandboxRequest(env="nope")), grpc.StatusCode.NOT_FOUND, "no environment")


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
