"""envd's Reset empties /tmp and /dev/shm and kills every process it can see: right inside a sandbox, ruinous on a
host. An envd running as root is no sandbox's (the sandbox user is never root), so its Reset is refused before it
touches anything, by the Python envd and by the compiled one. (A Reset once ran on this project's dev host from an
envd started there by hand, and emptied the host's /tmp.)"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import docker
import pytest

import envd.reset as reset
from orchestrator.backends.docker.sweeper import LABEL_MANAGED, LABEL_OWNER
from orchestrator.backends.envd_transport import EnvdTransport
from tests.conftest import TEST_OWNER


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the reset went on past its guard")


@pytest.mark.skipif(os.geteuid() != 0, reason="the guard is about an envd running as root")
def test_a_reset_as_root_is_refused_before_it_kills_or_wipes_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    # if the guard were gone, these stand-ins (not the real kill and wipe) are what the reset would reach
    monkeypatch.setattr(reset, "kill_all_others", _must_not_run)
    monkeypatch.setattr(reset, "_empty_dir", _must_not_run)
    monkeypatch.setattr(reset, "clear_ipc", _must_not_run)
    got = reset.reset_sandbox("/workspace", "/run/envd", "envd.sock", "")
    assert not got.ok and "root" in got.detail and got.killed == 0


async def test_the_compiled_envd_refuses_a_reset_as_root_too(
    docker_client: docker.DockerClient, base_image: str, tmp_path: Path
) -> None:
    # the Go envd as root, in a container of its own: should its guard be gone, the reset wipes and kills in there,
    # not on this host
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    (sockets / "token").write_text("root-token")
    container = docker_client.containers.run(
        base_image,
        ["sh", "-c", "echo kept > /tmp/canary && exec /opt/envfleet/bin/envd --socket /run/envd/envd.sock"],
        user="0:0",
        network_mode="none",
        tmpfs={"/tmp": "rw,size=16m"},
        volumes={str(sockets): {"bind": "/run/envd", "mode": "rw"}},
        labels={LABEL_MANAGED: "1", LABEL_OWNER: TEST_OWNER},
        detach=True,
    )
    transport = EnvdTransport(str(sockets / "envd.sock"), "root-token")
    try:
        for _ in range(200):
            if (sockets / "envd.sock").exists() and await transport.health(timeout=1):
                break
            await asyncio.sleep(0.05)
        got = await transport.reset("")
        assert not got.ok and "root" in got.detail, got
        r = await transport.exec(["cat", "/tmp/canary"])
        assert r.stdout == b"kept\n"
    finally:
        await transport.close()
        container.remove(force=True)
