"""Host integrity: a container's labels are claims, never facts. No label becomes a host path, no unsealed container
is swept, and no image built from tenant input carries the labels the sweep reads."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import docker
import docker.errors
import pytest

from orchestrator.backends.docker import DockerBackend, DockerBackendConfig
from orchestrator.backends.docker.sweeper import CONTROL_LABELS, LABEL_MANAGED, LABEL_OWNER, LABEL_SEAL, labels_for
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.image_spec import ImageSpec
from orchestrator.core.sandbox import SandboxSpec
from orchestrator.images import build_from_spec, build_image
from tests.conftest import REPO, TEST_OWNER


def _forged_image(client: docker.DockerClient, base: str, socket_dir: str) -> str:
    """An image a tenant built elsewhere (straight through the engine): it claims to be a managed sandbox whose lease
    has expired and whose socket directory is `socket_dir`."""
    tag = f"envfleet-test/forged:{uuid.uuid4().hex[:12]}"
    dockerfile = (
        f"FROM {base}\n"
        f"LABEL {LABEL_MANAGED}=1 {LABEL_OWNER}={TEST_OWNER} envfleet.lease_expiry=1 envfleet.owner_pid=1 \\\n"
        f'      envfleet.socket_dir="{socket_dir}"\n'
    )
    for chunk in client.api.build(
        fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True, forcerm=True, network_mode="none", decode=True
    ):
        assert "error" not in chunk, chunk
    return tag


def _run_cli_sweep(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "sweep", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_the_cli_sweeps_another_socket_roots_sandboxes_only_when_named(base_image: str, tmp_path: Path) -> None:
    # a server run with its own socket root (deploy/run.sh's) seals its sandboxes with that root's key: the sweep
    # verifies them with it, and without it leaves them alone, whatever their labels say
    config = DockerBackendConfig(owner=TEST_OWNER, socket_root=tmp_path / "sockets")
    backend = await DockerBackend.start(config)
    try:
        sandbox = await backend.create(SandboxSpec(image=base_image, ttl_s=0.5))
        await asyncio.sleep(1.0)  # its lease has run out
        default = await asyncio.to_thread(_run_cli_sweep)
        assert default.returncode == 0 and "removed 0 sandbox(es)" in default.stdout, default
        named = await asyncio.to_thread(_run_cli_sweep, "--socket-root", str(tmp_path / "sockets"))
        assert named.returncode == 0 and "removed 1 sandbox(es)" in named.stdout, named
        await sandbox.close()
    finally:
        await backend.close()


@pytest.mark.parametrize("through_link", [False, True], ids=["plain path", "path through a link"])
def test_a_forged_image_cannot_make_the_sweep_delete_a_host_directory(
    docker_client: docker.DockerClient, base_image: str, tmp_path: Path, through_link: bool
) -> None:
    canary = tmp_path / "canary"
    (canary / "victim").mkdir(parents=True)
    (canary / "victim" / "keep.txt").write_text("still here")
    target = canary / "victim"
    if through_link:
        # the label names a path whose parent is a link: an rmtree of it follows the link into the canary
        (tmp_path / "link").symlink_to(canary)
        target = tmp_path / "link" / "victim"
    image = _forged_image(docker_client, base_image, str(target))
    container = docker_client.containers.create(image, command=["true"])
    try:
        done = _run_cli_sweep()
        assert done.returncode == 0, done.stderr
        assert (canary / "victim" / "keep.txt").read_text() == "still here"
        # the sweep acted on nothing it could not verify: the forged container is still there
        assert docker_client.containers.get(container.id).labels[LABEL_MANAGED] == "1"
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
        docker_client.api.remove_image(image, force=True)


async def test_the_sweep_removes_a_link_in_the_socket_root_without_following_it(
    backend: DockerBackend, tmp_path: Path
) -> None:
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep.txt").write_text("still here")
    link = backend.config.socket_root / f"envfleet-{uuid.uuid4().hex[:12]}"
    link.symlink_to(canary)
    old = time.time() - 3600
    os.utime(link, (old, old), follow_symlinks=False)  # a leftover from long ago, as the sweep sees it
    try:
        await backend.sweep()
        assert not os.path.lexists(link)
        assert (canary / "keep.txt").read_text() == "still here"
    finally:
        if os.path.lexists(link):
            link.unlink()


async def test_a_spec_cannot_set_the_sweeps_labels(backend: DockerBackend) -> None:
    from orchestrator.backends.docker.sweeper import lease_over
    from orchestrator.core.processes import boot_id
    from orchestrator.core.sandbox import SandboxSpec

    forged = {"envfleet.lease_expiry": "1", "envfleet.lease_monotonic": f"{boot_id()}:1", LABEL_SEAL: "forged"}
    spec = SandboxSpec(image="x", labels={**forged, "team": "a"})
    labels = labels_for(backend.owner, spec, backend.sockets.seal("envfleet-000000000000"))
    assert labels["team"] == "a" and labels["envfleet.lease_expiry"] != "1"
    # the lease a sweep of this boot goes by is the sweep's own too: a spec that set it had its sandbox swept at once
    assert labels["envfleet.lease_monotonic"] != forged["envfleet.lease_monotonic"] and not lease_over(labels, 0.0)
    assert backend.sockets.verify("envfleet-000000000000", labels[LABEL_SEAL])
    assert not backend.sockets.verify("envfleet-000000000001", labels[LABEL_SEAL])


def test_a_tenant_dockerfile_with_the_sweeps_labels_is_refused(
    docker_client: docker.DockerClient, base_image: str
) -> None:
    dockerfile = f"FROM {base_image}\nLABEL team=a \\\n      envfleet.managed=1 envfleet.lease_expiry=1\n"
    with pytest.raises(InvalidRequestError, match=r"\['envfleet.lease_expiry', 'envfleet.managed'\] are reserved"):
        build_image(docker_client, name="test-forged-labels", dockerfile=dockerfile, context_files={})
    with pytest.raises(InvalidRequestError, match="reserved"):
        build_image(
            docker_client,
            name="test-forged-labels",
            dockerfile=f"FROM {base_image}\n",
            context_files={},
            labels={"envfleet.socket_dir": "/"},
        )
    # the SWE export's mark: its sweep removes a stopped container that carries it once its owner is gone
    with pytest.raises(InvalidRequestError, match=r"\['envfleet.swe.export'\] are reserved"):
        build_image(
            docker_client,
            name="test-forged-labels",
            dockerfile=f"FROM {base_image}\nLABEL envfleet.swe.export=1\n",
            context_files={},
        )


def test_an_image_spec_on_a_base_with_the_sweeps_labels_is_refused(
    docker_client: docker.DockerClient, base_image: str, tmp_path: Path
) -> None:
    base = _forged_image(docker_client, base_image, str(tmp_path))
    try:
        before = {t for i in docker_client.images.list(name="envfleet/test-forged-base") for t in i.tags}
        with pytest.raises(InvalidRequestError, match=r"carries labels \[.*'envfleet.managed'.*\], reserved"):
            build_from_spec(docker_client, name="test-forged-base", spec=ImageSpec(base=base, run=["true"]))
        after = {t for i in docker_client.images.list(name="envfleet/test-forged-base") for t in i.tags}
        assert after <= before, "the refused image is removed"
    finally:
        docker_client.api.remove_image(base, force=True)


def test_the_reserved_labels_are_the_ones_the_sweep_reads() -> None:
    from orchestrator.backends.docker import sweeper

    read = {v for k, v in vars(sweeper).items() if k.startswith("LABEL_")}
    assert read == set(CONTROL_LABELS)
