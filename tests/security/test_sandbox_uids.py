"""Each sandbox runs as a uid of its own. The kernel counts some limits per uid across every container of a host
(inotify instances and watches, processes against RLIMIT_NPROC, queued signals, pipe buffers): when every sandbox ran
as uid 100000, one sandbox (a policy's, any tenant's) that used one of them up failed the tests of every other."""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator
from typing import cast

import docker
import pytest

from orchestrator.backends.docker import DockerBackend, startup
from orchestrator.core.sandbox import SANDBOX_UIDS, Hardening, SandboxSpec

# opens inotify instances until the kernel refuses one, says how many, and holds them
HOG = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
held = 0
while libc.inotify_init() >= 0:
    held += 1
print(held, ctypes.get_errno(), flush=True)
time.sleep(120)
"""
ONE = "import ctypes; libc = ctypes.CDLL(None, use_errno=True); print(libc.inotify_init() >= 0, ctypes.get_errno())"


def _max_user_instances() -> int:
    with open("/proc/sys/fs/inotify/max_user_instances") as f:
        return int(f.read())


async def test_a_sandbox_that_uses_up_its_inotify_instances_leaves_the_others_theirs(
    backend: DockerBackend, base_image: str
) -> None:
    spec = SandboxSpec(image=base_image)
    async with await backend.create(spec) as hog, await backend.create(spec) as other:
        stream = cast(AsyncGenerator[object], hog.exec_stream(["python3", "-c", HOG], timeout=120))
        try:
            async for event in stream:
                data = getattr(event, "data", b"")
                if data:
                    held, errno = (int(x) for x in data.split())
                    break
            else:
                pytest.fail("the hog ended without saying how many instances it held")
            assert errno == 24 and 0 < held <= _max_user_instances(), "the hog reached its uid's limit (EMFILE)"
            r = await other.exec(["python3", "-c", ONE])
            assert r.stdout == b"True 0\n", r.stdout + r.stderr
        finally:
            await stream.aclose()


async def test_sandboxes_live_at_once_have_uids_of_their_own(backend: DockerBackend, base_image: str) -> None:
    spec = SandboxSpec(image=base_image)
    sandboxes = [await backend.create(spec) for _ in range(3)]
    try:
        uids = []
        for s in sandboxes:
            uid, gid = (int(x) for x in (await s.exec("id -u; id -g")).stdout.split())
            owner = (await s.exec(["stat", "-c", "%u:%g", "/workspace"])).stdout.strip()
            assert uid == gid and uid in SANDBOX_UIDS and owner == f"{uid}:{uid}".encode()
            assert s.name == f"envfleet-{uid:012x}"
            uids.append(uid)
        assert len(set(uids)) == 3
    finally:
        for s in sandboxes:
            await s.close()


def test_a_spec_cannot_name_a_uid_that_auto_gives() -> None:
    with pytest.raises(ValueError, match="'auto' gives each sandbox"):
        Hardening(user="100000:100000")  # the old default: it would share an auto sandbox's per-uid counts
    for root in ("0:0", "00:0", "000:5"):  # the engine reads "00" as uid 0
        with pytest.raises(ValueError, match="must not be root"):
            Hardening(user=root)
    assert Hardening(user=f"{SANDBOX_UIDS.stop}:{SANDBOX_UIDS.stop}").user == "2097152:2097152"


async def test_a_spec_that_names_its_user_gets_that_user_in_each_sandbox(
    backend: DockerBackend, base_image: str
) -> None:
    spec = SandboxSpec(image=base_image, hardening=Hardening(user="5000:5001"))
    async with await backend.create(spec) as a, await backend.create(spec) as b:
        for s in (a, b):
            assert (await s.exec("id -u; id -g")).stdout.split() == [b"5000", b"5001"]


async def test_a_picked_uid_another_sandbox_or_container_has_is_left_to_it_and_another_is_picked(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SandboxSpec(image=base_image)
    async with await backend.create(spec) as first:
        first_uid = int(first.name.removeprefix("envfleet-"), 16)
        # a container of the name of the next uid, made by someone else (another socket root, another tool): the
        # engine refuses the create for its name, and the create must not take it for its own and remove it
        foreign_uid = next(u for u in SANDBOX_UIDS if u != first_uid)
        foreign = docker_client.containers.create(
            base_image, ["true"], name=f"envfleet-{foreign_uid:012x}", network_disabled=True
        )
        try:
            picks = itertools.chain([first_uid, foreign_uid], iter(startup.pick_uid, None))
            monkeypatch.setattr(startup, "pick_uid", lambda: next(picks))
            async with await backend.create(spec) as second:
                uid = int((await second.exec(["id", "-u"])).stdout)
                assert uid not in (first_uid, foreign_uid) and second.name == f"envfleet-{uid:012x}"
            foreign.reload()
            assert foreign.name == f"envfleet-{foreign_uid:012x}"
            assert (await first.exec(["echo", "still here"])).stdout == b"still here\n"
        finally:
            foreign.remove(force=True)


async def test_a_failed_create_removes_a_container_of_its_name_only_if_it_is_its_own(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    # a create cancelled in the engine's call never learns its container's id, and cleans up by the name: names are
    # made of uids, so the name may be another socket root's live sandbox on the same engine (removed by name, force)
    foreign_name = f"envfleet-{SANDBOX_UIDS.stop - 1:012x}"
    foreign = docker_client.containers.create(base_image, ["true"], name=foreign_name, network_disabled=True)
    try:
        await backend.discard_unknown(foreign_name)
        foreign.reload()
        assert foreign.name == foreign_name, "another's container was left alone"
    finally:
        foreign.remove(force=True)
    own = await backend.create(SandboxSpec(image=base_image))
    try:
        await backend.discard_unknown(own.name)
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(own.id)
        assert not (backend.config.socket_root / own.name).exists()
    finally:
        await own.close()
