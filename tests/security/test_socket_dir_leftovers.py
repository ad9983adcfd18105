"""envd's socket directory without its tmpfs (`socket_tmpfs=false`): the host takes the directory once envd listens,
but a folder the sandbox made there before stayed the sandbox's, writable on the host's disk for its whole life
(50 MiB written into it after the take, in the audit). Now the take fails when anything but the socket is there. And
a tree deeper than Python's recursion made the directory's removal raise, stopping every sweep at it. A forked child
with a sandbox's uid plays the sandbox; real directories and a real unix socket."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from orchestrator.backends.docker.socket_dirs import SocketDirs

UID = 1234567
NAME = "envfleet-0000000abcde"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a sandbox's uid needs root to take")


def _as_sandbox(folder: Path, plant: str) -> None:
    """In a child with the sandbox's uid: plant a folder or a file of that name (or nothing) and listen on envd's
    socket."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.chdir(folder)
            os.setgid(UID)
            os.setuid(UID)
            if plant == "keep":
                os.mkdir("keep")
            elif plant:
                Path(plant).write_text("x")
            s = socket.socket(socket.AF_UNIX)
            s.bind("envd.sock")
            s.listen(1)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


@pytest.mark.parametrize(
    ("plant", "wrong"),
    [
        ("", ""),
        ("keep", "envd's folder holds more than its socket: ['keep']"),
        ("token", "envd listens but left its token file readable"),
    ],
)
def test_the_host_takes_a_socket_directory_holding_the_socket_alone(tmp_path: Path, plant: str, wrong: str) -> None:
    dirs = SocketDirs(tmp_path / "root", tmpfs=False, key_dir=tmp_path / "keys")
    folder = dirs.make(NAME, UID, UID)
    try:
        _as_sandbox(folder, plant)
        assert dirs.lock(NAME) == wrong
    finally:
        dirs.remove(NAME)
    assert not folder.exists()


def test_a_socket_directory_deeper_than_pythons_recursion_is_removed(tmp_path: Path) -> None:
    dirs = SocketDirs(tmp_path / "root", tmpfs=False, key_dir=tmp_path / "keys")
    folder = dirs.make(NAME, UID, UID)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(3000):  # made through fds: a path this deep is past PATH_MAX
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    dirs.remove(NAME)
    assert not folder.exists()
