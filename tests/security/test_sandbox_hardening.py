"""Sandbox hardening as the engine and the host report it: envd's socket directory, the sandbox uid, seccomp and
AppArmor, and the open-files limit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import docker
import pytest

from orchestrator.backends.docker import DockerBackend
from orchestrator.backends.docker.socket_dirs import SOCKET_NAME
from orchestrator.core.errors import SandboxCreateError
from orchestrator.core.sandbox import SandboxSpec
from orchestrator.images import build_image
from tests.conftest import ENVD_IS_LAUNCH_PY, REPO


async def test_a_big_write_into_the_socket_directory_fails_and_lands_nothing_on_the_host(
    backend: DockerBackend, base_image: str
) -> None:
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        host_dir = backend.config.socket_root / s.name
        free_before = shutil.disk_usage("/").free
        r = await s.exec("head -c 1G /dev/zero > /run/envd/big", timeout=120)
        assert r.exit_code != 0
        assert b"Permission denied" in r.stderr
        assert os.listdir(host_dir) == [SOCKET_NAME]
        # the directory is a tmpfs of its own, 64 KiB at most, not a folder on the host's disk
        vfs = os.statvfs(host_dir)
        assert vfs.f_blocks * vfs.f_frsize <= 64 << 10
        assert os.lstat(host_dir).st_dev != os.lstat("/").st_dev
        assert shutil.disk_usage("/").free > free_before - (256 << 20)  # others write too; 1 GiB would show


async def test_the_socket_root_is_ours_0700_and_each_directory_is_taken_from_the_sandbox(
    backend: DockerBackend, base_image: str
) -> None:
    root = os.lstat(backend.config.socket_root)
    assert stat.S_ISDIR(root.st_mode) and stat.S_IMODE(root.st_mode) == 0o700
    assert (root.st_uid, root.st_gid) == (os.geteuid(), os.getegid()) == (0, 0)
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        d = os.lstat(backend.config.socket_root / s.name)
        assert (d.st_uid, stat.S_IMODE(d.st_mode)) == (0, 0o755), "locked once envd listens"
        assert stat.S_ISSOCK(os.lstat(backend.config.socket_root / s.name / SOCKET_NAME).st_mode)
        r = await s.exec(["sh", "-c", "ln -s / /run/envd/x; rm -f /run/envd/envd.sock; ls /run/envd"])
        assert b"Permission denied" in r.stderr and r.stdout == b"envd.sock\n"
        assert (await s.exec(["echo", "still answering"])).stdout == b"still answering\n"


async def test_the_sandbox_uid_has_no_account_on_the_host(backend: DockerBackend, base_image: str) -> None:
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        uid, gid = (int(x) for x in (await s.exec("id -u; id -g")).stdout.split())
        assert uid == gid and uid >= 100000
        with pytest.raises(KeyError):
            pwd.getpwuid(uid)
        r = await s.exec("echo hi > /workspace/f && cat /workspace/f && echo x > /tmp/t && python3 -c 'print(1)'")
        assert (r.exit_code, r.stdout) == (0, b"hi\n1\n"), r.stderr


# an "envd" that plants a link where its socket should be, pointing at a socket on the host
LINKING_ENVD = b"""import os, time
os.symlink(os.environ["CANARY"], "/run/envd/envd.sock")
time.sleep(600)
"""


async def test_a_link_planted_at_envd_sock_is_never_followed(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    image = await asyncio.to_thread(
        build_image,
        docker_client,
        name="test-linking-envd",
        dockerfile=f"FROM {base_image}\nCOPY launch.py /opt/envfleet/envd/launch.py\n{ENVD_IS_LAUNCH_PY}",
        context_files={"launch.py": LINKING_ENVD},
    )
    canary_path = str(tmp_path / "canary.sock")
    canary = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    canary.bind(canary_path)
    canary.listen(8)
    canary.setblocking(False)
    try:
        spec = SandboxSpec(image=image, env={"CANARY": canary_path}, startup_timeout_s=3)
        with pytest.raises(SandboxCreateError, match="envd did not become healthy"):
            await backend.create(spec)
        with pytest.raises(BlockingIOError):
            canary.accept()  # nobody connected: the host never followed the link
    finally:
        canary.close()


async def test_seccomp_apparmor_and_nofile_as_the_engine_reports_them(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        info = docker_client.api.inspect_container(s.id)
        opts = info["HostConfig"]["SecurityOpt"] or []
        assert "no-new-privileges" in opts
        assert not [o for o in opts if o.endswith("unconfined")], opts
        # seccomp: the kernel's word from inside (2: a filter is installed), not only the engine's
        status = (await s.exec(["cat", "/proc/self/status"])).stdout.decode()
        assert "\nSeccomp:\t2\n" in status
        engine_security = " ".join(docker_client.info().get("SecurityOptions") or [])
        assert "name=seccomp" in engine_security and "profile=unconfined" not in engine_security
        if "name=apparmor" in engine_security:
            assert info["AppArmorProfile"] not in ("", "unconfined")
        else:
            # this host's kernel has no AppArmor: the engine applies none and says so with an empty profile
            assert info["AppArmorProfile"] == ""
        ulimits = {u["Name"]: (u["Soft"], u["Hard"]) for u in info["HostConfig"]["Ulimits"] or []}
        assert ulimits["nofile"] == (backend.config.nofile,) * 2
        assert (await s.exec("ulimit -n")).stdout == f"{backend.config.nofile}\n".encode()
        # no core dumps: a process that crashes in a loop started the host's core handler (systemd-coredump,
        # apport: root, outside the sandbox's cgroup) each time, and it wrote the sandbox's memory to the host's disk
        assert ulimits["core"] == (0, 0)
        assert (await s.exec("ulimit -c")).stdout == b"0\n"


async def test_a_sandboxs_output_to_the_engine_log_is_capped(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    # no log config: the engine's default (json-file, no rotation) kept whatever PID 1's stdout got, on the host's
    # disk, for the sandbox's life. A tenant's image whose envd is a wrapper left `yes` writing there
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        info = docker_client.api.inspect_container(s.id)
        assert info["HostConfig"]["LogConfig"] == {"Type": "json-file", "Config": {"max-size": "1m", "max-file": "1"}}
        # a command of the sandbox's user cannot reach envd's stdout: only an image's own PID 1 can write there
        r = await s.exec("echo x > /proc/1/fd/1", timeout=60)
        assert r.exit_code != 0 and b"Permission denied" in r.stderr, r
    # an image whose envd is a wrapper: it writes 8 MB to its stdout, then runs envd; the log on the host stays capped
    wrapper = (
        "#!/bin/sh\nhead -c 8000000 /dev/zero | tr '\\0' x | fold -w 100\nexec /opt/envfleet/bin/envd.real \"$@\"\n"
    )
    image = await asyncio.to_thread(
        build_image,
        docker_client,
        name="test-chatty-envd",
        dockerfile=(
            f"FROM {base_image}\nRUN mv /opt/envfleet/bin/envd /opt/envfleet/bin/envd.real\n"
            "COPY envd /opt/envfleet/bin/envd\nRUN chmod 0755 /opt/envfleet/bin/envd\n"
        ),
        context_files={"envd": wrapper.encode()},
    )
    async with await backend.create(SandboxSpec(image=image)) as s:
        log_path = Path(docker_client.api.inspect_container(s.id)["LogPath"])
        assert (await s.exec("echo alive")).stdout == b"alive\n"

        def kept() -> int:  # the engine's log files of it (the one written, and one it rotates away)
            total = 0
            for p in log_path.parent.glob(log_path.name + "*"):
                with contextlib.suppress(FileNotFoundError):  # rotated away meanwhile
                    total += p.stat().st_size
            return total

        sizes = [kept()]
        while len(sizes) < 40 and (len(sizes) < 3 or sizes[-1] != sizes[-3]):  # the engine copies it behind
            await asyncio.sleep(0.25)
            sizes.append(kept())
        assert 0 < sizes[-1] <= 2 << 20, sizes  # of 8 MB written


def test_a_cpu_quota_too_small_to_apply_is_refused() -> None:
    # 1e-10 cores was NanoCpus 0, which the engine takes as no limit at all (and admission counted the sandbox as
    # using no CPU): every sandbox of such a spec could use every core of the host
    from pydantic import ValidationError

    from orchestrator.core.sandbox import Limits

    for cpus in (1e-10, 0.009):
        with pytest.raises(ValidationError, match=r"greater than or equal to 0\.01"):
            Limits(cpus=cpus)
    assert Limits(cpus=0.01).cpus == 0.01


async def test_the_sweep_unmounts_and_removes_a_socket_directory_a_crashed_owner_left(backend: DockerBackend) -> None:
    name = f"envfleet-{uuid.uuid4().hex[:12]}"
    # made by an owner that then died before its container existed (a live creator's directory is kept)
    make = (
        "import sys; from orchestrator.backends.docker.socket_dirs import SocketDirs as D;"
        " D(sys.argv[1]).make(sys.argv[2], 100000, 100000)"
    )
    subprocess.run([sys.executable, "-c", make, str(backend.sockets.root), name], cwd=REPO, check=True)
    path = backend.sockets.path(name)
    try:
        assert os.path.ismount(path)
        (path / "junk").write_bytes(b"x" * 1000)
        with pytest.raises(OSError, match="No space left"):
            (path / "big").write_bytes(b"x" * (128 << 10))  # the cap holds for root on the host too
        old = time.time() - 3600
        os.utime(path, (old, old))
        await backend.sweep()
        assert not os.path.lexists(path)
        assert str(path) not in Path("/proc/self/mountinfo").read_text()
    finally:
        backend.sockets.remove(name)


async def test_an_images_entrypoint_and_healthcheck_never_run(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    """A tenant's image may say what runs first and what the engine execs on a timer: an ENTRYPOINT that took envd's
    command as its arguments (here it never starts envd), and a HEALTHCHECK run every 10 ms by the engine every
    tenant shares. Neither runs: envd is the sandbox's first process and its health check."""
    image = await asyncio.to_thread(
        build_image,
        docker_client,
        name="test-entrypoint-healthcheck",
        dockerfile=(
            f"FROM {base_image}\n"
            'ENTRYPOINT ["/bin/sleep", "infinity"]\n'
            'HEALTHCHECK --interval=10ms --timeout=1s CMD ["/bin/sh", "-c", "echo beat >> /tmp/beats"]\n'
        ),
        context_files={},
    )
    async with await backend.create(SandboxSpec(image=image, startup_timeout_s=10)) as s:
        await asyncio.sleep(0.5)
        attrs = docker_client.api.inspect_container(s.id)
        assert attrs["Config"]["Healthcheck"]["Test"] == ["NONE"]
        assert "Health" not in attrs["State"]
        r = await s.exec("cat /tmp/beats; cat /proc/1/cmdline | tr '\\0' ' '")
        assert b"beat" not in r.stdout and b"envd" in r.stdout


def test_an_engine_without_a_seccomp_filter_or_a_swap_limit_is_refused_at_the_backends_start() -> None:
    # a daemon run with `seccomp-profile: unconfined` (or built without seccomp) started every sandbox with no
    # system call filter, and nothing noticed: the test above checks this host, the backend now checks its engine
    from orchestrator.backends.docker.backend import engine_security_problem

    ok = {"SwapLimit": True}
    assert engine_security_problem({**ok, "SecurityOptions": ["name=seccomp,profile=default"]}) == ""
    assert engine_security_problem({**ok, "SecurityOptions": ["name=apparmor", "name=seccomp,profile=builtin"]}) == ""
    assert "unconfined" in engine_security_problem({**ok, "SecurityOptions": ["name=seccomp,profile=unconfined"]})
    assert "no seccomp profile" in engine_security_problem({**ok, "SecurityOptions": ["name=apparmor"]})
    assert "no seccomp profile" in engine_security_problem(ok)
    # and one with no swap accounting let every sandbox swap past its memory limit, unnoticed, unless allowed
    no_swap = {"SwapLimit": False, "SecurityOptions": ["name=seccomp,profile=default"]}
    assert "cannot limit swap" in engine_security_problem(no_swap)
    assert engine_security_problem(no_swap, allow_swap=True) == ""
