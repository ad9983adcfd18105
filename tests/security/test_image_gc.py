"""Tenants' images are a cache the engine's disk bounds: every image a tenant built stayed (a Validate's too), so one
tenant's old images could fill the disk and keep every other tenant's build out. Under disk pressure the least
recently used go first, never one a container uses or one used in the last minutes, never one that is not a
tenant's; and one removed is built again when it is next needed."""

from __future__ import annotations

import contextlib
import re
import shutil as real_shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from orchestrator.core.environment import Environment
from orchestrator.core.errors import ImageBuildError, SandboxCreateError
from orchestrator.core.processes import boot_id
from orchestrator.core.sandbox import SandboxSpec
from orchestrator.images import gc
from orchestrator.images.build import BuildLimits, build_image
from orchestrator.images.cache import default_cache_dir, safe_name
from orchestrator.images.resolver import BuildsOwnImage, ImageResolver
from tests.conftest import TEST_OWNER, owned_backend

GB = 1 << 30
BASE = "envfleet/base:latest"  # what the base_image fixture made this install's base


@pytest.fixture
def marker(monkeypatch: pytest.MonkeyPatch) -> str:
    """A name of this test's own: collections here remove only its images, not the suite's."""
    marker = uuid.uuid4().hex[:10]
    ours = re.compile(rf"^envfleet/env-gc-{marker}-[a-z]+:[0-9a-f]{{24}}$")
    monkeypatch.setattr(gc, "POLICY", gc.ImageGC(selects=ours))
    return marker


@pytest.fixture
def made(docker_client: docker.DockerClient) -> Iterator[list[str]]:
    """Images and containers a test made, removed at its end."""
    tags: list[str] = []
    yield tags
    for tag in tags:
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.images.remove(tag, force=True)
        (default_cache_dir() / "used" / safe_name(tag)).unlink(missing_ok=True)  # a sandbox's create marked it


def _tenant_image(client: docker.DockerClient, marker: str, which: str, cache: Path) -> str:
    """A tenant's image as a spec's build makes it: under limits, named env-..., 24 hex of its key."""
    return build_image(
        client,
        name=f"env-gc-{marker}-{which}",
        dockerfile=f"FROM {BASE}\nLABEL test.marker={marker} test.which={which}\n",
        context_files={},
        cache_dir=cache,
        limits=BuildLimits(disk_mb=2048),
        from_images=[BASE],
    )


def _used(tag: str, cache: Path, seconds_ago: float) -> None:
    (cache / "used").mkdir(exist_ok=True)
    (cache / "used" / safe_name(tag)).write_text(f"{boot_id()}:{time.monotonic() - seconds_ago:.0f}")


def _present(client: docker.DockerClient, tags: list[str]) -> list[str]:
    out = []
    for tag in tags:
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.get(tag)
            out.append(tag)
    return out


def _disk_freed_by_removals(
    monkeypatch: pytest.MonkeyPatch, client: docker.DockerClient, tags: list[str], free_gb: int
) -> None:
    """The engine's disk as 100 GB with `free_gb` free, and 5 GB more for each of `tags` removed."""

    def usage(path: str) -> Any:
        free = (free_gb + 5 * (len(tags) - len(_present(client, tags)))) * GB
        return real_shutil._ntuple_diskusage(100 * GB, 100 * GB - free, free)  # type: ignore[attr-defined]

    monkeypatch.setattr(real_shutil, "disk_usage", usage)


def test_tenants_images_are_removed_least_recently_used_first_and_never_one_in_use(
    docker_client: docker.DockerClient,
    base_image: str,
    tmp_path: Path,
    marker: str,
    made: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, c, d = (_tenant_image(docker_client, marker, w, tmp_path) for w in "abcd")
    made += [a, b, c, d]
    _used(a, tmp_path, 3 * 3600)
    _used(b, tmp_path, 2 * 3600)  # c: just built
    _used(d, tmp_path, 4 * 3600)  # the oldest, but a container of it exists (not even started)
    # the same image under a 12-hex tag is an operator's build, not a tenant's: never collected
    trusted = f"envfleet/env-gc-{marker}-t:0123456789ab"
    docker_client.images.get(a).tag(trusted)
    made.append(trusted)
    container = docker_client.containers.create(d, ["true"], labels={"envfleet.owner": TEST_OWNER}, network_mode="none")
    try:
        assert gc.candidates(docker_client, cache_dir=tmp_path) == [a, b]
        # marks are on the monotonic clock: a wall clock set an hour on leaves c as recently used as it was
        real = time.time
        with monkeypatch.context() as m:
            m.setattr(time, "time", lambda: real() + 3600)
            assert gc.candidates(docker_client, cache_dir=tmp_path) == [a, b]
        # under the high mark (80% full with the build's 2 GB), nothing goes
        _disk_freed_by_removals(monkeypatch, docker_client, [a, b, c, d], free_gb=22)
        assert gc.collect(docker_client, 2 * GB, cache_dir=tmp_path) == []
        # 92% full with the build's room, 5 GB a removal: the oldest goes, then 87% is under a low mark of 88%
        _disk_freed_by_removals(monkeypatch, docker_client, [a, b, c, d], free_gb=10)
        lenient = gc.ImageGC(low_share=0.88, selects=gc.POLICY.selects)
        assert gc.collect(docker_client, 2 * GB, lenient, cache_dir=tmp_path) == [a]
        assert _present(docker_client, [a, b, c, d, trusted]) == [b, c, d, trusted]
        assert not (tmp_path / "used" / safe_name(a)).exists()  # its mark went with it
        # at 87% the low mark of 80% takes the next; then none is left to remove, and c (recent) and d (in use) stay
        assert gc.collect(docker_client, 2 * GB, cache_dir=tmp_path) == [b]
        assert _present(docker_client, [b, c, d, trusted]) == [c, d, trusted]
    finally:
        container.remove(force=True)


def test_a_tenants_old_images_cannot_keep_the_next_build_out(
    docker_client: docker.DockerClient,
    base_image: str,
    tmp_path: Path,
    marker: str,
    made: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # every image stayed: a tenant's builds filled the disk to the build floor, and every tenant's next build was
    # refused for room until an operator pruned images by hand
    old = [_tenant_image(docker_client, marker, w, tmp_path) for w in ("old", "older")]
    made += old
    for tag in old:
        _used(tag, tmp_path, 3600)
    _disk_freed_by_removals(monkeypatch, docker_client, old, free_gb=6)  # 6 GB free, 5 kept: no room for 2 GB
    new = _tenant_image(docker_client, marker, "new", tmp_path)
    made.append(new)
    assert _present(docker_client, [*old, new]) == [new]
    # with nothing left to remove (the new one was used just now), the next is refused, and says what was done
    _disk_freed_by_removals(monkeypatch, docker_client, [], free_gb=6)
    with pytest.raises(ImageBuildError, match=r"with every tenant's image that no container uses .* removed"):
        _tenant_image(docker_client, marker, "next", tmp_path)


class _Own(Environment, BuildsOwnImage):
    """An environment whose image is a tenant's build of its own (a spec's, an archive's)."""

    name = "test-gc-own"
    marker = ""
    cache = Path()
    builds = 0

    def tasks(self) -> list[Any]:
        return []

    def build_image(self, client: docker.DockerClient) -> str:
        type(self).builds += 1
        return _tenant_image(client, self.marker, "own", self.cache)


async def test_an_image_removed_from_under_a_resolver_is_built_again(
    docker_client: docker.DockerClient, base_image: str, tmp_path: Path, marker: str, made: list[str]
) -> None:
    # the resolver kept each tag for its process's life: once a collection (or an operator) removed the image, every
    # rollout of its environment failed to make a sandbox, retried, and ended INFRA_ERROR
    env = type("Own", (_Own,), {"marker": marker, "cache": tmp_path})()
    resolver = ImageResolver(docker_client)
    tag, _ = await resolver.resolve(env)
    made.append(tag)
    assert await resolver.resolve(env) == (tag, docker_client.images.get(tag).id) and env.builds == 1  # cached
    docker_client.images.remove(tag, force=True)
    async with owned_backend() as backend:
        with pytest.raises(SandboxCreateError, match="not found"):
            await backend.create(SandboxSpec(image=tag))
        again, _ = await resolver.resolve(env)  # the failed create made it look again: built anew, same tag
        assert again == tag and env.builds == 2
        async with await backend.create(SandboxSpec(image=tag)) as sandbox:
            assert (await sandbox.exec(["true"])).ok
        # one resolved longer ago than a collection's minimum age allows for is looked up again before it is handed
        # out (a cache hit of its build: no new image)
        resolver._used[env.ref()] -= gc.REVERIFY_S + 1
        assert (await resolver.resolve(env))[0] == tag and env.builds == 3
        assert await resolver.resolve(env) == (tag, docker_client.images.get(tag).id) and env.builds == 3
