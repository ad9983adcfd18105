"""The reaper on a real engine: an owner process killed outright (a Ray node's raylet dying under its actors) has its
sandboxes removed by its backend's reaper, with no sweep run by anyone; an owner that closed its backend dismisses
its reaper; neither touches another owner's sandbox on the same socket root."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker

from orchestrator.backends.docker.socket_dirs import KEY_FILE, SocketDirs
from orchestrator.backends.docker.sweeper import LABEL_INSTANCE, LABEL_SEAL
from orchestrator.core.processes import owner_alive, proc_start_time, proc_stat
from orchestrator.core.sandbox import SandboxSpec
from tests.conftest import REPO, TEST_OWNER, owned_backend

REAPED_WITHIN_S = 20.0
REAPER = REPO / "orchestrator" / "backends" / "docker" / "reaper.py"
IDLE_RSS_KB = 32 * 1024  # the interpreter and the standard library; the docker SDK and pydantic add some 50 MB

# An owner of a backend: two sandboxes, then it waits (killed by the test) or closes its backend first.
OWNER_SCRIPT = """
import asyncio, sys
from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig
from orchestrator.core.sandbox import SandboxSpec

async def main():
    image, owner, root, then = sys.argv[1:]
    backend = await DockerBackend.start(DockerBackendConfig(owner=owner, socket_root=root), sweep=False)
    reaper = backend._reaper  # DockerBackend.start launched it, and close dismisses it
    for _ in range(2):
        await backend.create(SandboxSpec(image=image))
    print("ready", backend.owner.instance, reaper.pid if reaper else 0, flush=True)
    if then == "close":
        await backend.close()
        print("closed", flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin, or kills us

asyncio.run(main())
"""


class OwnerProcess:
    """The owner process of OWNER_SCRIPT, its reaper, and what is left of them at the end."""

    def __init__(self, image: str, socket_root: Path, then: str, log: Path) -> None:
        self.log = open(log, "wb")  # closed by end()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OWNER_SCRIPT, image, TEST_OWNER, str(socket_root), then],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,  # the reaper writes here too: a pipe would stay open as long as it lives
            cwd=REPO,
            text=True,
        )
        self.instance = ""
        self.reaper = 0
        self.reaper_start = ""

    async def line(self) -> str:
        assert self.proc.stdout is not None
        line: str = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 120)
        assert line, f"the owner died: {self.logs()}"
        return line.strip()

    async def ready(self) -> None:
        word, self.instance, reaper = (await self.line()).split()
        assert word == "ready"
        self.reaper = int(reaper)
        self.reaper_start = proc_start_time(self.reaper) if self.reaper else ""

    def reaper_alive(self) -> bool:
        return bool(self.reaper) and owner_alive(self.reaper, self.reaper_start)

    def logs(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-3000:]

    def end(self, docker_client: docker.DockerClient) -> None:
        """Kill what a failed test left: the owner, its reaper, its containers."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.reaper_alive():
            os.kill(self.reaper, signal.SIGKILL)
        for c in instance_containers(docker_client, self.instance) if self.instance else []:
            docker_client.api.remove_container(c["Id"], force=True)
        self.log.close()


def names(containers: list[dict[str, Any]]) -> list[str]:
    return sorted(c["Names"][0].lstrip("/") for c in containers)


def instance_containers(docker_client: docker.DockerClient, instance: str) -> list[dict[str, Any]]:
    return docker_client.api.containers(all=True, filters={"label": f"{LABEL_INSTANCE}={instance}"})  # type: ignore[no-any-return]


async def within(seconds: float, done: Callable[[], bool]) -> bool:
    """Whether `done()` holds within `seconds` (asked every 0.2 s)."""
    for _ in range(int(seconds / 0.2)):
        if done():
            return True
        await asyncio.sleep(0.2)
    return done()


def vm_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def test_a_killed_owners_sandboxes_are_removed_by_its_reaper(
    base_image: str, socket_root: Path, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    # the owner dies without its finally blocks and nothing else ever sweeps its engine (a Ray node that left the
    # cluster with its machine and dockerd still up): its sandboxes stayed forever, a lease counts only to a sweep
    async with owned_backend(socket_root=socket_root) as other:  # another live owner, same root, same key
        bystander = await other.create(SandboxSpec(image=base_image))
        owner = OwnerProcess(base_image, socket_root, "wait", tmp_path / "owner.log")
        try:
            await owner.ready()
            assert len(instance_containers(docker_client, owner.instance)) == 2
            # the instance's labels on a container no key of ours sealed: a claim the reaper must not act on
            labels = {**instance_containers(docker_client, owner.instance)[0]["Labels"], LABEL_SEAL: "0" * 64}
            forged = f"envfleet-{uuid.uuid4().hex[:12]}"
            docker_client.api.create_container(base_image, name=forged, labels=labels)
            detached = None
            if owner.reaper_alive():
                fields = proc_stat(owner.reaper)
                detached = (int(fields[1]), int(fields[2]), int(fields[3]), vm_rss_kb(owner.reaper))
            owner.proc.send_signal(signal.SIGKILL)
            owner.proc.wait()
            await within(REAPED_WITHIN_S, lambda: names(instance_containers(docker_client, owner.instance)) == [forged])
            left = names(instance_containers(docker_client, owner.instance))
            assert left == [forged], f"left {left}, not just the unsealed {forged}; {owner.logs()}"
            assert await within(REAPED_WITHIN_S, lambda: not owner.reaper_alive()), "the reaper outlived its sweep"
            assert sorted(os.listdir(socket_root)) == [KEY_FILE, bystander.name], "a socket directory was left"
            assert "removed 2 sandbox(es)" in owner.logs()
            # out of the owner's process group and session (signals to them, Ray's kill of a worker's group), not
            # its child (an exiting Ray worker kills its children), and idle at the size of a bare interpreter: the
            # docker SDK is imported only once the owner is gone
            assert detached is not None
            ppid, pgid, sid, rss_kb = detached
            assert ppid != owner.proc.pid and pgid != owner.proc.pid and sid != os.getsid(0)
            assert rss_kb < IDLE_RSS_KB, f"the idle reaper holds {rss_kb} kB"
            assert (await bystander.exec("echo alive")).stdout == b"alive\n"
        finally:
            owner.end(docker_client)
            await bystander.close()


async def test_an_owner_that_closed_its_backend_dismisses_its_reaper(
    base_image: str, socket_root: Path, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    # a process opens and closes many backends in its life (the test suite, a CLI command): the reaper of one it
    # closed leaves at once, without removing anything, and not when the process ends
    async with owned_backend(socket_root=socket_root) as other:
        bystander = await other.create(SandboxSpec(image=base_image))
        owner = OwnerProcess(base_image, socket_root, "close", tmp_path / "owner.log")
        try:
            await owner.ready()
            assert owner.reaper_alive(), f"no reaper was started: {owner.logs()}"
            assert await owner.line() == "closed"
            assert await within(REAPED_WITHIN_S, lambda: not owner.reaper_alive()), (
                "the dismissed reaper is still waiting for its owner"
            )
            assert owner.proc.poll() is None, "the owner should still be running"
            assert owner.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                owner.proc.stdin.close()
            assert await asyncio.to_thread(owner.proc.wait, 30) == 0
            assert not instance_containers(docker_client, owner.instance)
            assert sorted(os.listdir(socket_root)) == [KEY_FILE, bystander.name]
            assert (await bystander.exec("echo alive")).stdout == b"alive\n"
            assert "removed" not in owner.logs()
        finally:
            owner.end(docker_client)
            await bystander.close()


def test_a_reaper_whose_engine_never_answers_gives_up_with_a_log_line(tmp_path: Path) -> None:
    # it must not outlive its job: an engine gone for good (the node's dockerd stopped too) is asked a few times,
    # with backoff, and then the reaper exits saying what it left
    gone = subprocess.Popen(["sleep", "60"])
    start = proc_start_time(gone.pid)
    gone.kill()
    gone.wait()
    root = tmp_path / "s"
    SocketDirs(root)  # its key: a root without one is not even tried
    argv = [sys.executable, "-P", str(REAPER), "--owner-pid", str(gone.pid), "--owner-start", start]
    argv += ["--instance", "0" * 32, "--socket-root", str(root), "--engine", f"unix://{tmp_path}/no-engine.sock"]
    began = time.monotonic()
    reaper = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert reaper.returncode == 1, reaper.stderr
    assert f"gave up on the sandboxes of backend {'0' * 32} after 5 tries" in reaper.stderr
    assert reaper.stderr.count("asking again in") == 4
    assert time.monotonic() - began >= 1 + 2 + 4 + 8
