"""The OCI runtime is a tenant's choice, within the operator's allowlist: gVisor's runsc runs the hardened sandbox and
envd when the engine has it; a runtime off the allowlist is INVALID_ARGUMENT, and one the engine lacks fails the
create closed (never a sandbox under a weaker runtime). No test here restarts or reconfigures the engine: where runsc
is registered (scripts/ensure-docker.sh does it), the gVisor tests run; elsewhere they skip."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import docker
import grpc
import pytest

from orchestrator.backends.config import DockerBackendConfig
from orchestrator.backends.docker import DockerBackend
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import ConfigError, LimitNotAppliedError
from orchestrator.core.sandbox import SANDBOX_UIDS, SandboxSpec
from protos import orchestrator_pb2 as pb
from tests.conftest import TEST_OWNER
from tests.orchestrator.servers import FAKE, FAKE_BASE_IMAGE, expect_error, serve


def _engine_has(client: docker.DockerClient, runtime: str) -> bool:
    return runtime in (client.info().get("Runtimes") or {})


@pytest.fixture
def runsc(docker_client: docker.DockerClient) -> None:
    if not _engine_has(docker_client, "runsc"):
        pytest.skip("the docker engine has no runsc runtime (scripts/ensure-docker.sh registers it where installed)")


async def test_a_runtime_off_the_allowlist_is_invalid_argument(tmp_path: Path) -> None:
    async with serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as c:
        await expect_error(
            c.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE, runtime="runc")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "runtime 'runc' is not allowed; caps.sandbox.runtimes allows: runsc",
        )
        spec = pb.EnvironmentSpec(name="rt", version="1", tools=["submit"], runtime="kata")
        spec.tasks.add(id="t", prompt="p")
        spec.scoring.command = "echo '{\"reward\": 1}'"
        await expect_error(c.env_stub.Validate(spec), grpc.StatusCode.INVALID_ARGUMENT, "runtime 'kata' is not allowed")


async def test_a_runtime_the_engine_lacks_fails_the_create(tmp_path: Path, base_image: str) -> None:
    """Allowed by the operator but not registered with the engine: FAILED_PRECONDITION naming what to do, and no
    container is made (the owned-backend fixture of serve fails the test on a leak)."""
    caps = {"sandbox": {"runtimes": ["envfleet-no-such-runtime"]}}
    async with serve(tmp_path, caps=caps) as orch, EnvfleetClient(orch.address) as c:
        await expect_error(
            c.sandbox_stub.Create(pb.CreateSandboxRequest(image=base_image, runtime="envfleet-no-such-runtime")),
            grpc.StatusCode.FAILED_PRECONDITION,
            "the docker engine has no OCI runtime 'envfleet-no-such-runtime'",
            "/etc/docker/daemon.json",
        )


async def test_a_default_runtime_the_engine_lacks_stops_the_backend_from_starting(base_image: str) -> None:
    with pytest.raises(ConfigError, match="no OCI runtime 'envfleet-no-such-runtime'"):
        await DockerBackend.start(DockerBackendConfig(owner=TEST_OWNER, runtime="envfleet-no-such-runtime"))
    backend = await DockerBackend.start(DockerBackendConfig(owner=TEST_OWNER), sweep=False)
    try:
        with pytest.raises(LimitNotAppliedError, match="no OCI runtime 'envfleet-no-such-runtime'"):
            await backend.create(SandboxSpec(image=base_image, runtime="envfleet-no-such-runtime"))
        assert not await backend.list_owned()
    finally:
        await backend.close()


@pytest.mark.usefixtures("runsc")
async def test_a_runsc_sandbox_runs_envd_on_gvisors_kernel(backend: DockerBackend, base_image: str) -> None:
    """The whole hardened create under runsc: read-only root, tmpfs, cap-drop, pids limit, a uid of its own, envd on a
    unix socket in the bind-mounted directory. The kernel that answers is gVisor's, not the host's."""
    async with await backend.create(SandboxSpec(image=base_image, runtime="runsc")) as box:
        dmesg = await box.exec("dmesg")
        assert dmesg.ok and b"gVisor" in dmesg.stdout, dmesg
        host = Path("/proc/version").read_bytes()
        assert (await box.exec(["cat", "/proc/version"])).stdout != host
        assert int((await box.exec("id -u")).stdout) == int(box.name.removeprefix("envfleet-"), 16) in SANDBOX_UIDS
        assert not (await box.exec("touch /etc/x")).ok  # read-only root
        assert (await box.exec("grep CapEff /proc/self/status")).stdout.split()[-1] == b"0000000000000000"
        # no sub-reaper in this gVisor: envd finds what an exec left under init instead, and kills it
        await box.exec("(env -i setsid sh -c 'sleep 1000' &); echo started")
        left = await box.exec("for p in /proc/[0-9]*; do cat $p/cmdline; echo; done | grep -c '^sleep' || true")
        assert left.stdout.strip() == b"0", left

        # stdin streamed into a process under gVisor
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(8):
                yield b"z" * (1 << 20)

        assert (await box.exec("wc -c", stdin=chunks())).stdout.strip() == str(8 << 20).encode()
