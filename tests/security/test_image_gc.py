"""Tenants' images are a cache the engine's disk bounds: every image a tenant built stayed (a Validate's too), so one
tenant's old images could fill the disk and keep every other tenant's build out. Under disk pressure the least
recently used go first, never one a container uses or one used in the last minutes, never one that is not a
tenant's; and one removed is built again when it is next needed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil as real_shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import docker
import docker.errors
import pytest

from orchestrator.core.environment import Environment
from orchestrator.core.errors import BuildRoomError, SandboxCreateError
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
    with pytest.raises(BuildRoomError, match=r"tenants' images that no container uses .* removed first"):
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


def test_only_tenants_builds_match_what_a_collection_may_remove() -> None:
    may = gc.TENANT_TAG.match
    assert may("envfleet/env-word-count:" + "a" * 24) and may("envfleet/env-harbor-x-y:" + "0" * 24)
    for tag in (
        "envfleet/base:latest",
        "envfleet/base:" + "a" * 12,
        "envfleet/env-python-tool:" + "a" * 12,  # a plug-in's ImageSpec: the operator's build
        "envfleet/swe/toolz-1:" + "a" * 24,
        "envfleet/orchestrator:" + "a" * 24,
        "other/env-x:" + "a" * 24,
    ):
        assert not may(tag), tag


class _Engine:
    """The engine calls a collection makes, over a disk of 100 GB that frees 5 GB an image removed."""

    def __init__(self, tags: list[str], free_gb: float, on_remove: Any = None) -> None:
        self.tags, self.free_gb, self.on_remove = list(tags), free_gb, on_remove
        self.removed: list[str] = []
        self.api = self

    def info(self) -> dict[str, str]:
        return {"DockerRootDir": "/"}

    def containers(self, all: bool) -> list[dict[str, str]]:
        return []

    def images(self) -> list[dict[str, Any]]:
        return [{"Id": f"sha256:{n}", "RepoTags": [t], "Created": 0} for n, t in enumerate(self.tags)]

    def remove_image(self, tag: str) -> None:
        self.tags.remove(tag)
        self.removed.append(tag)
        self.free_gb += 5
        if self.on_remove is not None:
            self.on_remove(tag)


def _fake_disk(monkeypatch: pytest.MonkeyPatch, engine: _Engine) -> None:
    def usage(path: str) -> Any:
        free = int(engine.free_gb * GB)
        return real_shutil._ntuple_diskusage(100 * GB, 100 * GB - free, free)  # type: ignore[attr-defined]

    monkeypatch.setattr(real_shutil, "disk_usage", usage)


def test_an_image_used_while_a_collection_runs_is_judged_again_before_it_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the list was made once and every tag on it removed: one a resolver looked up meanwhile (its mark fresh, the
    # image found) was removed under it, and its rollout's sandbox could not be made
    tags = [f"envfleet/env-gc-{w}:{'0' * 24}" for w in "ab"]
    for n, tag in enumerate(tags):
        gc.mark_used(tag, tmp_path, now=True)
        _used(tag, tmp_path, 7200 - n)
    engine = _Engine(tags, free_gb=2, on_remove=lambda tag: gc.mark_used(tags[1], tmp_path, now=True))
    _fake_disk(monkeypatch, engine)
    assert gc.collect(engine, cache_dir=tmp_path) == [tags[0]]  # type: ignore[arg-type]
    assert engine.tags == [tags[1]]


def test_a_collection_keeps_the_builds_floor_free_on_a_small_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # only the share full started one: on a disk of 100 GB at 84% full, a build that needed 20 GB kept free was refused
    # while an image unused for an hour could have made the room
    tag = f"envfleet/env-gc-a:{'0' * 24}"
    gc.mark_used(tag, tmp_path, now=True)
    _used(tag, tmp_path, 3600)
    engine = _Engine([tag], free_gb=17)
    _fake_disk(monkeypatch, engine)
    assert gc.collect(engine, GB, cache_dir=tmp_path) == []  # type: ignore[arg-type]
    assert gc.collect(engine, GB, cache_dir=tmp_path, keep_free_bytes=20 * GB) == [tag]  # type: ignore[arg-type]


def test_marks_of_images_gone_are_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every build leaves a mark, a failed one too: a tenant's stream of failing Dockerfiles added a file each, for good
    monkeypatch.setattr(gc, "MAX_MARKS", 3)
    kept = f"envfleet/env-gc-kept:{'0' * 24}"
    engine = _Engine([kept], free_gb=50)
    for n in range(6):
        gc.mark_used(f"envfleet/env-gc-failed{n}:{'0' * 24}", tmp_path, now=True)
    gc.mark_used(kept, tmp_path, now=True)
    old = time.time() - 3600
    for path in (tmp_path / "used").iterdir():
        os.utime(path, (old, old))
    gc.mark_used(f"envfleet/env-gc-fresh:{'0' * 24}", tmp_path, now=True)  # a build under way: not on the engine yet
    assert gc.prune_marks(engine, tmp_path) == 6  # type: ignore[arg-type]
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == sorted(
        safe_name(t) for t in (kept, f"envfleet/env-gc-fresh:{'0' * 24}")
    )


async def test_an_image_gone_as_it_is_resolved_is_the_hosts_failure(tmp_path: Path) -> None:
    # found by its build (a cache hit), then removed before its id was read: the engine's 404 was an ImageBuildError,
    # the rollout ENV_ERROR (never retried, the environment blamed)
    from orchestrator.core.errors import EngineError

    class Gone(Environment, BuildsOwnImage):
        name = "test-gc-gone"

        def tasks(self) -> list[Any]:
            return []

        def build_image(self, client: docker.DockerClient) -> str:
            raise docker.errors.ImageNotFound("No such image: envfleet/env-x:0")

    class Resolver(ImageResolver):
        def build_own_image(self, env: BuildsOwnImage) -> str:
            return env.build_image(self._client)

    with pytest.raises(EngineError, match="was removed as it was resolved"):
        await Resolver(cast(docker.DockerClient, None)).resolve(Gone())


def test_an_image_being_built_is_never_collected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a build may outlast the minimum age (up to its 15 minutes) with only its start's mark: its lock says it is used
    from orchestrator.images.cache import file_lock

    tag = f"envfleet/env-gc-slow:{'0' * 24}"
    gc.mark_used(tag, tmp_path, now=True)
    _used(tag, tmp_path, 3600)
    engine = _Engine([tag], free_gb=2)
    _fake_disk(monkeypatch, engine)
    with file_lock(tmp_path / "locks", tag):
        assert gc.collect(engine, cache_dir=tmp_path) == []  # type: ignore[arg-type]
    assert gc.collect(engine, cache_dir=tmp_path) == [tag]  # type: ignore[arg-type]


async def test_builds_under_way_leave_the_shared_thread_pool_to_the_rest() -> None:
    # builds ran on asyncio's shared pool (min(32, cores + 4) threads): a tenant's jobs on as many environments whose
    # images were being built held every thread, and each sandbox's create (its pty cap), the sweep and SubmitJob's
    # conversion waited behind them for as long as the builds took
    import threading

    release = threading.Event()

    def env_named(n: int) -> Environment:
        class Slow(Environment, BuildsOwnImage):
            name = f"test-gc-slow-{n}"

            def tasks(self) -> list[Any]:
                return []

            def build_image(self, client: docker.DockerClient) -> str:
                release.wait(30)
                return "envfleet/base:latest"

        return Slow()

    class Resolver(ImageResolver):
        def _build(self, env: Environment) -> tuple[str, str]:
            assert isinstance(env, BuildsOwnImage)
            return env.build_image(self._client), "sha256:0"

    resolver = Resolver(cast(docker.DockerClient, None))
    builds = [asyncio.ensure_future(resolver.resolve(env_named(n))) for n in range(min(32, (os.cpu_count() or 1) + 4))]
    try:
        await asyncio.sleep(0.2)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 1), 5) == 1
    finally:
        release.set()
        await asyncio.gather(*builds)
