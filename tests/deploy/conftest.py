"""The orchestrator's image, and containers of it started the documented way (deploy/run.sh)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.conftest import REPO, TEST_OWNER

RUN_SH = REPO / "deploy" / "run.sh"


@pytest.fixture(scope="session")
def orchestrator_image(docker_client: docker.DockerClient, base_image: str) -> str:
    """`envfleet/orchestrator:<hash>`, built once (cached by the hash of its inputs)."""
    from orchestrator.images.orchestrator_image import ensure_orchestrator_image

    return ensure_orchestrator_image(docker_client)


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def docker_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The docker command line (what an operator types), its output as text."""
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)


@dataclass
class Deployment:
    """How one test runs the orchestrator's container: the settings deploy/run.sh reads."""

    image: str
    name: str
    port: int
    socket_root: Path
    volume: str

    @property
    def address(self) -> str:
        """The server's address on host loopback (--network host)."""
        return f"127.0.0.1:{self.port}"

    def start(self, *serve_flags: str) -> None:
        """deploy/run.sh IMAGE --owner <the suite's> --metrics-port -1 SERVE_FLAGS; waits for `listening`."""
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("ENVFLEET_")},
            "ENVFLEET_NAME": self.name,
            "ENVFLEET_PORT": str(self.port),
            "ENVFLEET_SOCKET_ROOT": str(self.socket_root),
            "ENVFLEET_DATA_VOLUME": self.volume,
            "ENVFLEET_LOG_FORMAT": "json",
            "ENVFLEET_VERBOSE": "1",
        }
        argv = [str(RUN_SH), self.image, "--owner", TEST_OWNER, "--metrics-port", "-1", *serve_flags]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, f"deploy/run.sh failed: {proc.stderr}"
        deadline = time.monotonic() + 60
        while "listening" not in self.logs():
            state = self.state()
            assert state.get("Running"), f"the container stopped: {state}\n{self.logs()}"
            assert time.monotonic() < deadline, f"the server did not start:\n{self.logs()}"
            time.sleep(0.2)

    def logs(self) -> str:
        """stdout and stderr of the container so far."""
        p = docker_cli("logs", self.name)
        return p.stdout + p.stderr

    def log_records(self) -> list[dict[str, object]]:
        """The container's stderr, where the server logs (as JSON lines: ENVFLEET_LOG_FORMAT=json), parsed."""
        lines = docker_cli("logs", self.name).stderr.splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def state(self) -> dict[str, object]:
        """`docker inspect`'s State of the container."""
        p = docker_cli("inspect", "--format", "{{json .State}}", self.name)
        assert p.returncode == 0, p.stderr
        state: dict[str, object] = json.loads(p.stdout)
        return state

    def health(self) -> dict[str, Any]:
        """`docker inspect`'s health of the container (Status: starting, healthy, unhealthy; the probes' log)."""
        health = self.state().get("Health")
        return health if isinstance(health, dict) else {}

    def remove(self) -> None:
        """The container stopped the operator's way (SIGTERM: its sandboxes destroyed), then removed."""
        docker_cli("stop", "--time", "30", self.name)
        docker_cli("rm", "--force", self.name)


@pytest.fixture
def deployment(orchestrator_image: str, tmp_path: Path) -> Iterator[Deployment]:
    """Settings for one container (its name, port, socket root and data volume); all removed afterwards."""
    tag = uuid.uuid4().hex[:8]
    d = Deployment(
        orchestrator_image,
        f"envfleet-deploy-test-{tag}",
        free_port(),
        tmp_path / "sockets",
        f"envfleet-deploy-test-{tag}",
    )
    try:
        yield d
    finally:
        d.remove()
        docker_cli("volume", "rm", "--force", d.volume)
        # deploy/run.sh made the socket root a (shared) mount point
        subprocess.run(["umount", "--recursive", "--lazy", str(d.socket_root)], capture_output=True, check=False)
