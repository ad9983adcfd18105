"""The socket-root sweep that every docker backend of a host runs (real engine, real processes): a create that stalls
between its socket directory and its container keeps both through another backend's sweep, however old the
directory; the directory of a creator that died before its container existed is removed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.docker.socket_dirs import CREATING
from orchestrator.core.sandbox import SandboxSpec
from tests.conftest import REPO, owned_backend

pytestmark = pytest.mark.docker


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


async def test_a_stalled_create_keeps_its_directory_through_another_backends_sweep(
    base_image: str, socket_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with owned_backend(socket_root=socket_root) as creator, owned_backend(socket_root=socket_root) as other:
        at_engine, go_on = threading.Event(), threading.Event()
        real_create = creator.api.create_container

        def stalled(*args: Any, **kwargs: Any) -> Any:  # the engine takes minutes to create this container
            at_engine.set()
            go_on.wait(120)
            return real_create(*args, **kwargs)

        monkeypatch.setattr(creator.api, "create_container", stalled)
        creating = asyncio.create_task(creator.create(SandboxSpec(image=base_image)))
        try:
            assert await asyncio.to_thread(at_engine.wait, 120)
            [name] = creator.sockets.names()
            _age(socket_root / name, 600)  # long past the sweep's threshold
            await other.sweep()
            assert (socket_root / name).is_dir(), "another backend's sweep removed a live create's directory"
            assert not creator.sockets.token_taken(name), "the sandbox's token is gone"
        finally:
            go_on.set()
            await asyncio.wait([creating])  # a failed test too: the backend then holds the sandbox, and removes it
        async with creating.result() as sandbox:
            assert (await sandbox.exec(["echo", "ok"])).stdout == b"ok\n"
            _age(socket_root / name, 600)  # its container exists now: that keeps it
            await other.sweep()
            assert (await sandbox.exec(["echo", "still"])).stdout == b"still\n"
        assert sorted(os.listdir(socket_root)) == [".seal-key"], "a create left its lock or directory behind"


CREATOR = """
import sys, time
from pathlib import Path
from orchestrator.backends.docker.socket_dirs import SocketDirs

SocketDirs(Path(sys.argv[1])).make(sys.argv[2], 100000, 100000)  # and then stalls, before any container exists
print("made", flush=True)
time.sleep(1000)
"""


async def test_a_dead_creators_directory_is_swept_and_a_live_ones_kept(base_image: str, socket_root: Path) -> None:
    async with owned_backend(socket_root=socket_root) as sweeper:
        name = "envfleet-0123456789ab"
        proc = subprocess.Popen(
            [sys.executable, "-c", CREATOR, str(socket_root), name], stdout=subprocess.PIPE, cwd=REPO, text=True
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert line.strip() == "made"
            _age(socket_root / name, 600)
            await sweeper.sweep()
            assert (socket_root / name).is_dir(), "the sweep removed the directory of a live process's create"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        # an orphan from before locks existed (no lock file), and a lock whose creator died before its mkdir
        legacy = "envfleet-ba9876543210"
        (socket_root / legacy).mkdir(mode=0o700)
        _age(socket_root / legacy, 600)
        lone_lock = socket_root / f"envfleet-aaaaaaaaaaaa{CREATING}"
        lone_lock.touch(0o600)
        _age(lone_lock, 600)
        young = "envfleet-bbbbbbbbbbbb"  # too young to judge: it stays
        (socket_root / young).mkdir(mode=0o700)
        assert (socket_root / f"{name}{CREATING}").exists()
        await sweeper.sweep()
        assert sorted(os.listdir(socket_root)) == [".seal-key", young]
        sweeper.sockets.remove(young)
