"""What a repository export leaves when it fails or its process is killed: its container is swept by the next
export once its owner is gone (a live owner's is spared), and a failed write leaves no temporary file. What it
holds: a repository over MAX_REPO_TAR_BYTES is refused while it streams (the dataset made it), and the exports kept
in memory stay within MAX_CACHED_REPO_BYTES."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
import docker.errors
import pytest

from environments.swe import images
from environments.swe.images import RepositoryTooLargeError, RepoTars, environment_image, instance_image, swe_cache
from environments.swe.report import write_atomic
from tests.conftest import REPO, stop_process
from tests.environments.swe.conftest import Tiny

# an export whose archive read blocks once its container exists: it says so (the container id in `ready`) and waits
# to be killed, as a process killed during get_archive would
STUCK_EXPORT = """
import asyncio, sys, time
from pathlib import Path
from docker.models.containers import Container
from environments.swe.images import RepoTars
from environments.swe.instance import SweInstance

instance = SweInstance.model_validate_json(Path(sys.argv[1]).read_text())
env_image, cache, ready = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])

def stuck(self, *args, **kwargs):
    (ready.parent / (ready.name + ".tmp")).write_text(self.id)
    (ready.parent / (ready.name + ".tmp")).rename(ready)
    time.sleep(600)

Container.get_archive = stuck
asyncio.run(RepoTars(cache_dir=cache).tar(instance, env_image))
"""


def _exists(client: docker.DockerClient, cid: str) -> bool:
    try:
        client.containers.get(cid)
    except docker.errors.NotFound:
        return False
    return True


def _start_stuck_export(tiny: Tiny, env_image: str, tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    """A real process stuck inside an export, and its export container's id."""
    spec = tmp / f"{name}.json"
    spec.write_text(tiny.pytest.model_dump_json())
    ready = tmp / f"{name}.ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_EXPORT, str(spec), env_image, str(tmp / f"{name}-cache"), str(ready)], cwd=REPO
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise AssertionError(f"the stuck export did not reach get_archive (exit {proc.returncode})")
        time.sleep(0.05)
    return proc, ready.read_text()


async def test_an_export_killed_midway_is_swept_by_the_next_export_and_a_live_ones_spared(
    tiny: Tiny, base_image: str, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    env_image = environment_image(docker_client, tiny.pytest.environment, base=base_image)
    instance_image(docker_client, tiny.pytest, env_image=env_image)  # built here, not inside the child's wait
    live, live_cid = _start_stuck_export(tiny, env_image, tmp_path, "live")
    ours = [live_cid]
    try:
        killed, killed_cid = _start_stuck_export(tiny, env_image, tmp_path, "killed")
        ours.append(killed_cid)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        assert _exists(docker_client, killed_cid), "the killed export's container should be there to sweep"

        # the next export, in another process (here), with nothing cached: it sweeps, then exports
        tar = await RepoTars(docker_client, cache_dir=tmp_path / "next").tar(tiny.pytest, env_image)
        assert tar, "the next export still works"
        assert not _exists(docker_client, killed_cid), "the export container of a killed process was left behind"
        assert _exists(docker_client, live_cid), "the sweep removed the export container of a live process"

        # the live one's owner is gone now too: the next export sweeps its container as well
        live.kill()
        live.wait()
        await RepoTars(docker_client, cache_dir=tmp_path / "after").tar(tiny.pytest, env_image)
        left = [cid for cid in ours if _exists(docker_client, cid)]
        assert not left, f"export containers left: {[c[:12] for c in left]}"
    finally:
        live.kill()
        live.wait()
        for cid in ours:
            with contextlib.suppress(docker.errors.NotFound):
                docker_client.containers.get(cid).remove(force=True)


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    with pytest.raises(UnicodeEncodeError):
        write_atomic(tmp_path / "report.json", "\udc80")  # a lone surrogate: encoding fails after the file is made
    (tmp_path / "patch.diff").mkdir()
    with pytest.raises(IsADirectoryError):
        write_atomic(tmp_path / "patch.diff", "x")  # the rename fails: a directory is in the way
    assert sorted(p.name for p in tmp_path.iterdir()) == ["patch.diff"]


async def test_a_failed_repository_cache_write_leaves_no_temporary_file(
    tiny: Tiny, base_image: str, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    env_image = environment_image(docker_client, tiny.pytest.environment, base=base_image)
    tag = instance_image(docker_client, tiny.pytest, env_image=env_image)
    image_id = str(docker_client.images.get(tag).id).removeprefix("sha256:")
    repos = swe_cache(tmp_path) / "repos"
    (repos / f"{image_id[:32]}.tar").mkdir(parents=True)  # the rename into the cache fails: a directory is there
    with pytest.raises(IsADirectoryError):
        await RepoTars(docker_client, cache_dir=tmp_path).tar(tiny.pytest, env_image)
    assert sorted(p.name for p in repos.iterdir()) == [f"{image_id[:32]}.tar"]


async def test_a_repository_over_the_limit_is_refused_as_it_streams(
    tiny: Tiny, base_image: str, docker_client: docker.DockerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env_image = environment_image(docker_client, tiny.pytest.environment, base=base_image)
    tag = instance_image(docker_client, tiny.pytest, env_image=env_image)
    monkeypatch.setattr(images, "MAX_REPO_TAR_BYTES", 4 << 10)  # the tiny repository is more than 4 KiB as a tar
    with pytest.raises(RepositoryTooLargeError, match=r"the repository of .* is over 0 MiB as a tar"):
        await RepoTars(docker_client, cache_dir=tmp_path).tar(tiny.pytest, env_image)
    exports = docker_client.containers.list(all=True, filters={"label": images.EXPORT_LABEL, "ancestor": tag})
    assert exports == []  # its export container went with it
    assert not list((swe_cache(tmp_path) / "repos").glob("*.tar"))  # and nothing was cached


async def test_the_exports_kept_in_memory_are_bounded(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []

    def load(self: RepoTars, instance: object, env_image: str) -> bytes:
        loads.append(env_image)
        return env_image.encode() * 100  # 400 bytes each: what the disk cache would give

    monkeypatch.setattr(RepoTars, "_load", load)
    monkeypatch.setattr(images, "MAX_CACHED_REPO_BYTES", 1000)
    repos = RepoTars()
    for image in ("img1", "img2", "img1", "img3", "img1", "img2"):
        await repos.tar(tiny.pytest.model_copy(update={"instance_id": image}), image)
    # img1, used most recently each time, stays; img2 is dropped for img3 and read again
    assert loads == ["img1", "img2", "img3", "img2"]


def test_an_exports_lease_is_its_own_length_from_now() -> None:
    # the lease's argument became a length, and the export still passed a time: its lease ran 56 years, and only the
    # age check on the engine's clock removed a stuck export
    from orchestrator.backends.docker.sweeper import LABEL_LEASE, Owner, lease_over

    labels = images.export_labels(Owner.current(images.EXPORT_OWNER))
    assert abs(float(labels[LABEL_LEASE]) - (time.time() + images.EXPORT_LEASE_S)) < 5
    assert not lease_over(labels, time.time())


def test_a_wall_clock_set_on_never_takes_a_live_exports_container() -> None:
    # the age check ran before the owner's: a clock set 15 minutes on made a live sibling's export "older than 900s",
    # and it was removed mid-export; the age counts only for an export that names no owner
    from orchestrator.backends.docker.sweeper import Owner

    me = Owner.current(images.EXPORT_OWNER)
    labels = images.export_labels(me)
    now = time.time()
    stepped = now + 2 * images.EXPORT_LEASE_S
    assert images.export_verdict(labels, "x", now, stepped, me, {}) == ""
    legacy = {images.EXPORT_LABEL: "1"}
    assert images.export_verdict(legacy, "x", now, stepped, me, {}).startswith("older than")
    assert images.export_verdict(legacy, "x", now, now + 1, me, {}) == ""
