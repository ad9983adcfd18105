"""Group snapshots against real sandboxes: what a restore puts in the workspace, and what follows a refused one."""

from __future__ import annotations

import pytest

from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.core.errors import SandboxError
from orchestrator.core.sandbox import Sandbox, SandboxSpec
from orchestrator.rollout.snapshots import SnapshotCache

SETUP = (
    "mkdir -p deps/sub && echo ready > deps/prepared.txt && ln -s prepared.txt deps/link"
    " && ln -f deps/prepared.txt hard"  # a hard link: the snapshot names its source under the workspace too
)


async def test_a_refused_restore_drops_the_snapshot_for_the_rest_of_the_group(
    backend: DockerBackend, base_image: str
) -> None:
    """A sandbox whose envd refuses the snapshot fails as infrastructure (its retry gets a fresh sandbox), and the
    group's later samples run the setup instead of failing on the same snapshot."""
    cache = SnapshotCache()
    setups: list[str] = []

    async def prepare(box: Sandbox) -> str:
        async def setup() -> None:
            setups.append(box.spec.workspace)
            r = await box.exec(SETUP)
            assert r.exit_code == 0, r.stderr

        return await cache.prepare(("j", "t"), box, box.spec.workspace, setup)

    async def listing(box: Sandbox) -> bytes:
        r = await box.exec("find . | sort; readlink deps/link; stat -c %h hard; cat deps/link")
        return r.stdout

    async with (
        await backend.create(SandboxSpec(image=base_image)) as first,
        await backend.create(SandboxSpec(image=base_image)) as second,
        await backend.create(SandboxSpec(image=base_image)) as refusing,
        await backend.create(SandboxSpec(image=base_image)) as last,
    ):
        assert await prepare(first) == "built"
        held = cache.held_bytes("j")
        assert held > 0
        # restored into the workspace itself: the same files, links and hard links as the setup left
        assert await prepare(second) == "restored"
        assert await listing(second) == await listing(first)
        # a link where the snapshot has a directory: envd refuses to write through it
        assert (await refusing.exec("ln -s /tmp deps")).exit_code == 0
        with pytest.raises(SandboxError, match=r"snapshot of t could not be restored: .*deps.*symbolic link"):
            await prepare(refusing)
        assert cache.held_bytes("j") == 0, "the dropped snapshot's bytes are given back"
        assert len(setups) == 1
        assert await prepare(last) == "fallback"
        assert len(setups) == 2
        assert await listing(last) == await listing(first)
