"""The docker backend on a real engine: exec through envd, hardening, limits, files, sweeping and concurrency."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import docker
import pytest

from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig, DockerSandbox
from orchestrator.backends.docker.host_config import leftovers
from orchestrator.backends.docker.socket_dirs import SocketDirs
from orchestrator.backends.docker.sweeper import (
    LABEL_INSTANCE,
    LABEL_LEASE,
    LABEL_LEASE_MONOTONIC,
    LABEL_MANAGED,
    LABEL_OWNER,
)
from orchestrator.core.errors import (
    SandboxCreateError,
    SandboxDiedError,
    SandboxPermissionError,
    SandboxStartTimeoutError,
    SandboxUnavailableError,
)
from orchestrator.core.sandbox import SANDBOX_UIDS, ExecOutput, Limits, SandboxSpec
from tests.conftest import ENVD_IS_LAUNCH_PY, REPO, TEST_OWNER, owned_containers


@pytest.fixture
async def sandbox(backend: DockerBackend, base_image: str) -> AsyncIterator[DockerSandbox]:
    s = await backend.create(SandboxSpec(image=base_image))
    yield s
    await s.close()


async def test_exec_basics_through_envd(sandbox: DockerSandbox) -> None:
    r = await sandbox.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
    r = await sandbox.exec(["cat"], stdin=b"piped")
    assert r.stdout == b"piped"
    r = await sandbox.exec("echo $X; pwd", env={"X": "y"}, cwd="/tmp")
    assert r.stdout == b"y\n/tmp\n"
    events = [ev async for ev in sandbox.exec_stream("echo a; sleep 0.1; echo b >&2; sleep 0.1; echo c")]
    assert [(e.stream, e.data) for e in events if isinstance(e, ExecOutput)] == [
        ("stdout", b"a\n"),
        ("stderr", b"b\n"),
        ("stdout", b"c\n"),
    ]


async def test_not_root_and_root_filesystem_is_read_only(sandbox: DockerSandbox) -> None:
    uid, gid = (int(x) for x in (await sandbox.exec("id -u; id -g")).stdout.split())
    assert uid == gid and uid in SANDBOX_UIDS
    assert sandbox.name == f"envfleet-{uid:012x}"
    r = await sandbox.exec("touch /usr/evil")
    assert r.exit_code != 0 and b"Read-only file system" in r.stderr
    r = await sandbox.exec("touch /evil")
    assert r.exit_code != 0
    # the workspace and /tmp are writable, with a size cap
    r = await sandbox.exec("touch /workspace/ok /tmp/ok && df -m /tmp /workspace | tail -2")
    assert r.exit_code == 0, r.stderr


async def test_inspect_shows_every_hardening_flag(sandbox: DockerSandbox, docker_client: docker.DockerClient) -> None:
    hc = docker_client.api.inspect_container(sandbox.id)["HostConfig"]
    cfg = docker_client.api.inspect_container(sandbox.id)["Config"]
    lim = sandbox.spec.limits
    assert hc["NetworkMode"] == "none"
    assert hc["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in hc["SecurityOpt"]
    assert hc["ReadonlyRootfs"] is True
    assert hc["PidsLimit"] == lim.pids
    assert hc["Memory"] == lim.memory_mb << 20
    assert hc["NanoCpus"] == int(lim.cpus * 1e9)
    assert not hc["Init"]  # envd is PID 1 (tests/security/test_envd_signals.py), not docker's init
    assert set(hc["Tmpfs"]) == {"/tmp", "/workspace", "/dev/shm"}
    left = leftovers(lim)
    for path, mb in (("/tmp", left.tmp_mb), ("/workspace", left.workspace_mb), ("/dev/shm", left.shm_mb)):
        assert f"size={mb}m,nr_inodes={left.inodes(mb)}" in hc["Tmpfs"][path]
    assert hc["Sysctls"]["kernel.shmmax"] == str(left.shm_mb << 20)
    assert left.charged_mb() <= lim.memory_mb * 3 // 4, "what outlives a command fits under the memory with a reserve"
    uid = int(sandbox.name.removeprefix("envfleet-"), 16)
    assert cfg["User"] == f"{uid}:{uid}" and uid in SANDBOX_UIDS
    assert cfg["Labels"][LABEL_MANAGED] == "1" and cfg["Labels"][LABEL_OWNER] == TEST_OWNER
    assert float(cfg["Labels"][LABEL_LEASE]) > time.time()


async def test_timeout_kills_grandchildren_in_the_sandbox(sandbox: DockerSandbox) -> None:
    r = await sandbox.exec("sleep 1000 & setsid sleep 1001 & sleep 1000", timeout=1)
    assert r.timed_out and r.exit_code == 137
    ps = await sandbox.exec(["ps", "-eo", "args"])
    assert b"sleep 100" not in ps.stdout, ps.stdout.decode()


async def test_output_flood_is_capped(sandbox: DockerSandbox) -> None:
    r = await sandbox.exec(["yes"], max_output=64 << 10, timeout=2)
    assert r.truncated and r.timed_out and len(r.stdout) == 64 << 10


async def test_fork_bomb_hits_the_pids_limit_and_spares_the_neighbours(backend: DockerBackend, base_image: str) -> None:
    spec = SandboxSpec(image=base_image, limits=Limits(pids=64))
    async with await backend.create(spec) as bomb, await backend.create(SandboxSpec(image=base_image)) as other:
        r = await bomb.exec("bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout=8)
        assert b"fork" in r.stderr.lower() or b"resource temporarily unavailable" in r.stderr.lower(), r.stderr[-500:]
        # the neighbour and the host keep working
        assert (await other.exec("echo fine")).stdout == b"fine\n"
        host = subprocess.run(["true"], check=False)
        assert host.returncode == 0
        # and the bomb's own envd still answers once the timeout killed the tree
        assert (await bomb.exec("echo back")).stdout == b"back\n"


async def test_memory_hog_is_reported_as_oom(backend: DockerBackend, base_image: str) -> None:
    spec = SandboxSpec(image=base_image, limits=Limits(memory_mb=128))
    async with await backend.create(spec) as s:
        hog = "a = []\nwhile True: a.append(bytearray(16 << 20))\n"
        r = await s.exec(["python3", "-c", hog], timeout=30)
        assert r.oom_killed and r.signal == 9, r
        assert (await s.exec("echo alive")).stdout == b"alive\n"


async def test_no_network_inside(sandbox: DockerSandbox) -> None:
    r = await sandbox.exec("ls /sys/class/net")
    assert r.stdout.split() == [b"lo"]
    # a TCP server on the host's loopback cannot be reached from inside
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        probe = textwrap.dedent(f"""
            import socket
            s = socket.socket(); s.settimeout(2)
            try:
                s.connect(("127.0.0.1", {port})); print("connected")
            except OSError as e:
                print("refused", e)
        """)
        r = await sandbox.exec(["python3", "-c", probe], timeout=10)
        assert r.stdout.startswith(b"refused"), r.stdout
    finally:
        server.close()


async def test_files_round_trip_and_symlinks_not_followed(sandbox: DockerSandbox) -> None:
    await sandbox.write_file("src/app.py", b"print('hi')\n")
    assert await sandbox.read_file("/workspace/src/app.py") == b"print('hi')\n"
    assert (await sandbox.exec(["python3", "src/app.py"])).stdout == b"hi\n"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("pkg/mod.py")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"x\n"))
    assert await sandbox.upload(buf.getvalue(), "/workspace/up") == 1
    with tarfile.open(fileobj=io.BytesIO(await sandbox.download("/workspace/up"))) as tar:
        assert sorted(tar.getnames()) == ["up", "up/pkg", "up/pkg/mod.py"]
    await sandbox.exec("ln -s /etc/shadow shadow && ln -s /run/envd hostdir")
    with pytest.raises(SandboxPermissionError, match="symbolic link"):
        await sandbox.read_file("shadow")
    with pytest.raises(SandboxPermissionError, match="symbolic link"):
        await sandbox.write_file("hostdir/planted", b"x")
    names = {e.name: e.kind for e in await sandbox.list_dir("/workspace")}
    assert names["shadow"] == "symlink" and names["hostdir"] == "symlink"


async def test_container_killed_from_outside_is_reported(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    s = await backend.create(SandboxSpec(image=base_image))
    try:
        docker_client.api.kill(s.id)
        with pytest.raises(SandboxDiedError, match="stopped from outside"):
            await s.exec("true")
        st = await s.state()
        assert not st.running
    finally:
        await s.close()


def _image_with_launcher(client: docker.DockerClient, base: str, name: str, launcher: str) -> str:
    dockerfile = f"FROM {base}\nRUN printf '%s\\n' '{launcher}' > /opt/envfleet/envd/launch.py\n{ENVD_IS_LAUNCH_PY}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile.encode()))
    buf.seek(0)
    tag = f"envfleet-test/{name}:latest"
    client.images.build(fileobj=buf, custom_context=True, tag=tag, network_mode="none", rm=True)
    return tag


async def test_sandbox_that_never_gets_healthy_is_destroyed_with_its_logs(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    stuck = _image_with_launcher(
        docker_client, base_image, "stuck", 'import time; print("envd stuck", flush=True); time.sleep(1000)'
    )
    broken = _image_with_launcher(docker_client, base_image, "broken", 'import sys; sys.exit("envd broke")')
    mine = {"label": f"{LABEL_INSTANCE}={backend.owner.instance}"}  # not other work on this host
    before = {c["Id"] for c in docker_client.api.containers(all=True, filters=mine)}
    try:
        with pytest.raises(SandboxStartTimeoutError, match=r"(?s)did not become healthy within 2s.*envd stuck"):
            await backend.create(SandboxSpec(image=stuck, startup_timeout_s=2))
        with pytest.raises(SandboxCreateError, match=r"(?s)exited during startup.*envd broke"):
            await backend.create(SandboxSpec(image=broken, startup_timeout_s=20))
        with pytest.raises(SandboxCreateError, match="not found"):
            await backend.create(SandboxSpec(image="envfleet-test/none:missing"))
        after = {c["Id"] for c in docker_client.api.containers(all=True, filters=mine)}
        assert after <= before, "a failed create left a container behind"
        assert not await backend.list_owned()
    finally:
        for tag in (stuck, broken):
            docker_client.images.remove(tag, force=True)


OWNER_SCRIPT = """
import asyncio, sys
from orchestrator.backends.docker import DockerBackend, DockerBackendConfig
from orchestrator.core.sandbox import SandboxSpec

async def main():
    # no reaper: this is the start-up sweep's test (test_reaper.py has the reaper's); a socket root and key folder
    # of its own when named
    where = dict(zip(("socket_root", "seal_key_dir"), sys.argv[3:]))
    b = await DockerBackend.start(DockerBackendConfig(owner=sys.argv[2], reaper=False, **where), sweep=False)
    for _ in range(3):
        await b.create(SandboxSpec(image=sys.argv[1]))
    print("ready", flush=True)
    await asyncio.sleep(1000)

asyncio.run(main())
"""


async def _killed_owner(base_image: str, owner: str, *where: str) -> None:
    """An owner process that made 3 sandboxes, SIGKILLed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, base_image, owner, *where], stdout=subprocess.PIPE, cwd=REPO, text=True
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
        assert line.strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


async def test_sandboxes_of_a_killed_owner_are_swept(base_image: str, docker_client: docker.DockerClient) -> None:
    owner = f"{TEST_OWNER}-crash"
    await _killed_owner(base_image, owner)
    flt = {"label": [f"{LABEL_MANAGED}=1", f"{LABEL_OWNER}={owner}"]}
    left = owned_containers(owner)
    assert len(left) == 3, "the killed owner's sandboxes should still exist before the sweep"
    sweeper = await DockerBackend.start(DockerBackendConfig(owner=TEST_OWNER))  # sweeps at start
    try:
        assert docker_client.api.containers(all=True, filters=flt) == []
        for c in left:
            assert not os.path.lexists(sweeper.config.socket_root / c.name)
    finally:
        await sweeper.close()


async def test_sandboxes_from_before_a_reboot_are_swept_after_it(
    base_image: str, socket_root: Path, tmp_path: Path
) -> None:
    # the sweep's key lived in the socket root alone, under /run, a tmpfs: after a reboot the root was new, its key
    # too, and the sandboxes from before it (back as exited) were claims no sweep could verify, left for good
    owner = f"{TEST_OWNER}-reboot"
    await _killed_owner(base_image, owner, str(socket_root), str(tmp_path / "keys"))
    assert len(owned_containers(owner)) == 3
    dirs = SocketDirs(socket_root, key_dir=tmp_path / "keys")
    for name in dirs.names():  # the reboot: /run is empty again
        dirs.remove(name)
    shutil.rmtree(socket_root)
    config = DockerBackendConfig(owner=TEST_OWNER, socket_root=socket_root, seal_key_dir=tmp_path / "keys")
    sweeper = await DockerBackend.start(config)  # sweeps at start
    try:
        assert owned_containers(owner) == []
    finally:
        await sweeper.close()
        for c in owned_containers(owner):  # what the sweep could not verify
            c.remove(force=True)


async def test_sweep_keeps_live_owners_and_removes_expired_leases(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    live = await backend.create(SandboxSpec(image=base_image))
    short = await backend.create(SandboxSpec(image=base_image, ttl_s=1))
    other = await DockerBackend.start(DockerBackendConfig(owner=TEST_OWNER), sweep=False)
    try:
        await asyncio.sleep(1.5)
        removed = await other.sweep()
        assert removed == 1
        names = {
            c["Names"][0].lstrip("/")
            for c in docker_client.api.containers(all=True, filters={"label": f"{LABEL_MANAGED}=1"})
        }
        assert live.name in names and short.name not in names
        assert (
            docker_client.api.inspect_container(live.id)["Config"]["Labels"][LABEL_INSTANCE] == backend.owner.instance
        )
    finally:
        await other.close()
        await live.close()
        await short.close()


async def _removed_soon(backend: DockerBackend, docker_client: docker.DockerClient, cid: str) -> None:
    """The container is gone within 10 s (its removal runs in the backend's own task), and the backend holds none."""
    for _ in range(100):
        if not docker_client.api.containers(all=True, filters={"id": cid}):
            break
        await asyncio.sleep(0.1)
    assert not docker_client.api.containers(all=True, filters={"id": cid})
    assert backend.owned(cid) is None


@pytest.mark.parametrize("how", ["close", "release"])
async def test_a_sandbox_whose_removal_is_cancelled_midway_is_removed_all_the_same(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient, how: str
) -> None:
    # marked closed, then cancelled while its connection closed (a pool closing, a rollout's cancel): no later
    # close() would remove it, and this backend's sweep keeps what it holds, so it stayed until its lease ended
    sb = await backend.create(SandboxSpec(image=base_image))
    closing = sb.transport.close

    async def slow_close() -> None:
        await asyncio.sleep(1)
        await closing()

    sb.transport.close = slow_close  # type: ignore[method-assign]
    task = asyncio.create_task(getattr(sb, how)())
    await asyncio.sleep(0.2)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await _removed_soon(backend, docker_client, sb.id)


async def test_a_sandbox_made_as_its_caller_is_cancelled_is_removed(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the create finished in the loop turn its caller was cancelled (a rollout's timeout, a job's cancel): the caller
    # got the cancel, no one held the sandbox, and this backend's sweep kept it (it is its own) until its lease ended
    create = backend._create
    made: list[DockerSandbox] = []
    caller: asyncio.Task[DockerSandbox] | None = None

    async def made_as_cancelled(spec: SandboxSpec) -> DockerSandbox:
        sandbox = await create(spec)
        made.append(sandbox)
        assert caller is not None
        asyncio.get_running_loop().call_soon(caller.cancel)  # before the caller's wake-up: the same turn
        return sandbox

    monkeypatch.setattr(backend, "_create", made_as_cancelled)
    caller = asyncio.create_task(backend.create(SandboxSpec(image=base_image)))
    with pytest.raises(asyncio.CancelledError):
        await caller
    (sb,) = made
    await _removed_soon(backend, docker_client, sb.id)


async def test_a_sandboxs_lease_ends_no_later_than_its_label_says(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # counted from the end of the create, the lease in memory ran past the label's by the create's time, which the
    # sweep goes by: a slow create's sandbox was handed out (and recycled) after the sweep could remove it
    from orchestrator.backends.docker import startup

    ready = startup.wait_ready

    async def slow_ready(*args: object, **kwargs: object) -> None:
        await asyncio.sleep(3)
        await ready(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(startup, "wait_ready", slow_ready)
    sb = await backend.create(SandboxSpec(image=base_image))
    async with sb:
        labels = docker_client.api.inspect_container(sb.id)["Config"]["Labels"]
        label = float(labels[LABEL_LEASE_MONOTONIC].partition(":")[2])  # the clock the sweep goes by on this boot
        assert sb.lease_expiry <= label, (sb.lease_expiry, label)
        assert float(labels[LABEL_LEASE]) > time.time() + 3000  # and the wall clock's, for another boot's sweep


def test_a_lease_runs_out_on_the_monotonic_clock_of_its_boot_not_the_wall_clock() -> None:
    # the wall clock set an hour on (NTP, a VM resumed) expired every sandbox in use at the next sweep, a sibling
    # worker's too: INFRA_ERRORs and a cold pool. Its monotonic lease, on this boot, is what counts
    from orchestrator.backends.docker.sweeper import lease_over
    from orchestrator.core.processes import boot_id

    now = time.time()
    in_use = {LABEL_LEASE: f"{now + 600:.0f}", LABEL_LEASE_MONOTONIC: f"{boot_id()}:{time.monotonic() + 600:.0f}"}
    assert boot_id() and not lease_over(in_use, now) and not lease_over(in_use, now + 3600)  # the jump
    over = {**in_use, LABEL_LEASE_MONOTONIC: f"{boot_id()}:{time.monotonic() - 1:.0f}"}
    assert lease_over(over, now)  # the wall clock says otherwise: the monotonic one decides
    # another boot's (the engine's containers outlived a reboot), or a label of an older version: the wall clock's
    other_boot = {**in_use, LABEL_LEASE_MONOTONIC: f"another-boot:{time.monotonic() + 600:.0f}"}
    assert lease_over(other_boot, now + 3600) and not lease_over(other_boot, now)
    assert lease_over({LABEL_LEASE: f"{now - 1:.0f}"}, now) and not lease_over({}, now)


async def test_the_engine_watch_outlives_a_failed_sweep_and_close_still_removes_everything(
    base_image: str, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the engine answered again and the sweep that follows failed (a 500 while it listed): the watch ended with the
    # error, unseen, and close() raised it before it removed a single sandbox
    b = await DockerBackend.start(
        DockerBackendConfig(owner=TEST_OWNER, health_interval_s=0.05, reaper=False), sweep=False
    )
    try:
        sb = await b.create(SandboxSpec(image=base_image))
        ping, answers = b.engine.ping, [False]

        async def flaky_ping() -> bool:
            return answers.pop() if answers else await ping()

        async def failing_sweep() -> int:
            raise docker.errors.APIError("the engine's 500 while it listed")

        monkeypatch.setattr(b.engine, "ping", flaky_ping)
        monkeypatch.setattr(b, "sweep", failing_sweep)
        await asyncio.sleep(1.0)  # it went, came back, and the sweep after failed
        assert b._health_task is not None and not b._health_task.done()
    finally:
        await b.close()
    assert not docker_client.api.containers(all=True, filters={"id": sb.id})


async def test_fifty_concurrent_sandboxes_leave_nothing_behind(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    async def one(i: int) -> bytes:
        async with await backend.create(SandboxSpec(image=base_image, limits=Limits(memory_mb=256))) as s:
            return (await s.exec(["echo", str(i)])).stdout

    outs = await asyncio.gather(*(one(i) for i in range(50)))
    assert sorted(outs) == sorted(f"{i}\n".encode() for i in range(50))
    assert not await backend.list_owned()
    assert docker_client.api.containers(all=True, filters={"label": f"{LABEL_OWNER}={TEST_OWNER}"}) == []
    t0 = time.monotonic()
    docker_client.ping()
    assert time.monotonic() - t0 < 5, "the daemon should stay responsive"


async def test_docker_exec_transport_behind_the_same_interface(backend: DockerBackend, base_image: str) -> None:
    async with await backend.create(SandboxSpec(image=base_image, transport="docker-exec")) as s:
        r = await s.exec("echo out; echo err >&2; exit 4")
        assert (r.exit_code, r.stdout, r.stderr) == (4, b"out\n", b"err\n")
        assert (await s.exec(["cat"], stdin=b"in")).stdout == b"in"
        r = await s.exec("sleep 100", timeout=1)
        assert r.timed_out
        r = await s.exec(["yes"], max_output=1000, timeout=1)
        assert r.truncated and len(r.stdout) == 1000
        await s.write_file("/workspace/f.txt", b"data")
        assert await s.read_file("/workspace/f.txt") == b"data"
        assert [e.name for e in await s.list_dir("/workspace")] == ["f.txt"]


async def test_a_docker_exec_command_started_while_the_last_ones_leftovers_are_killed_is_spared(
    backend: DockerBackend, base_image: str
) -> None:
    # the engine cannot tell one command's processes from another's: when the last command running ends, every
    # process but init and the keeper is killed. A command started while that kill ran was killed with them
    async with await backend.create(SandboxSpec(image=base_image, transport="docker-exec")) as s:
        transport = s.transport  # type: ignore[attr-defined]
        kill = transport.kill_leftovers

        async def slow_kill() -> None:
            await asyncio.sleep(1)  # two engine round trips, on a loaded host
            await kill()

        transport.kill_leftovers = slow_kill
        first = asyncio.create_task(s.exec("true"))
        await asyncio.sleep(0.5)  # ended, its kill under way
        second = await s.exec("sleep 1.5; echo spared", timeout=10)
        assert (await first).exit_code == 0
        assert (second.exit_code, second.stdout) == (0, b"spared\n")


async def test_a_failed_call_waits_for_the_engines_verdict_a_bounded_while(
    sandbox: DockerSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # whether the container died was asked of the engine with no bound of its own: a dockerd restarting or hung kept
    # the answer for the limiter's queue and 120 s, and a rollout whose deadline fell meanwhile was TIMEOUT, the
    # policy's outcome, where its sandbox had failed (SandboxUnavailableError: INFRA_ERROR, retried)
    from orchestrator.backends.docker import backend as backend_module

    async def hung(cid: str) -> None:
        await asyncio.sleep(300)

    async def unavailable(*args: object) -> bytes:
        raise SandboxUnavailableError("envd did not answer")

    monkeypatch.setattr(backend_module, "DIAGNOSE_S", 0.5)
    monkeypatch.setattr(sandbox._backend, "state_of", hung)
    monkeypatch.setattr(sandbox.transport, "read_file", unavailable)
    started = time.monotonic()
    with pytest.raises(SandboxUnavailableError, match="envd did not answer"):
        await sandbox.read_file("/etc/hostname")
    assert time.monotonic() - started < 5
