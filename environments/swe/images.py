"""Images in tiers, each tagged by a hash of its build inputs and reused when present:

    base (envd; orchestrator.images)  ->  environment (dependencies from host-downloaded wheels, fixed env vars)
                                      ->  instance (the repository at base_commit in /opt/repo, one root commit)

Sources are fetched on the host as files, never run there (sources.py: a PyPI sdist from the index's Simple API, a
local archive that must be a regular file), checked against their sha256, into the cache (`$ENVFLEET_CACHE/swe`,
default ~/.cache/envfleet/swe), and the builds run with no network. A prebuilt `image` source must be an envfleet SWE
image (`envfleet/swe/...`). Blocking calls: run them in a thread from async code.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import io
import logging
import re
import tarfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import docker.errors

from environments.swe.instance import ArchiveSource, EnvironmentSpec, ImageSource, SdistSource, SweInstance
from environments.swe.report import write_atomic
from environments.swe.sources import MAX_SOURCE_BYTES, copy_archive, fetch_sdist, open_archive
from orchestrator.backends.docker.sweeper import LABEL_EXPORT, LABEL_MANAGED, LABEL_PID, Owner, doomed, owner_labels
from orchestrator.core.echo import echo
from orchestrator.core.errors import EnvironmentBroken, ImageBuildError, InvalidRequestError
from orchestrator.images import ensure_base_image
from orchestrator.images.build import REPO_PREFIX, BuildLimits, build_image
from orchestrator.images.cache import default_cache_dir, file_lock, image_exists, safe_name
from orchestrator.images.wheels import fetch_site

log = logging.getLogger(__name__)

REPO_DIR = "/opt/repo"
SITE_DIR = "/opt/swe/site"
IMAGE_ENV = {"TZ": "UTC", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "LC_ALL": "C.UTF-8"}
# the images this module builds (image_name); a dataset's `image` source must be one of them, never another
# environment's (envfleet/env-*), the operator's, or a non-envfleet image
SWE_IMAGE_PREFIX = f"{REPO_PREFIX}/swe/"
_SNAPSHOT = Path(__file__).with_name("snapshot.py")
# the container a repository is exported from (RepoTars): created, read, removed; never started
EXPORT_LABEL = LABEL_EXPORT  # reserved: no image built from tenant input may carry it (sweeper.CONTROL_LABELS)
EXPORT_OWNER = "envfleet-swe-export"
# an export reads one repository out of the image in seconds: a container older than this is left over, whoever
# its owner (one of another pid namespace, whose liveness cannot be judged from here, included)
EXPORT_LEASE_S = 900.0
# A repository as exported from its instance image: the dataset made it (its sdist unpacks to up to 8 GiB, and its
# image's build may add more), and the export is read into this process's memory, re-rooted, and uploaded into each
# sandbox. Past this the task cannot run (ENV_ERROR naming the size); the largest of the shipped repositories is
# a few MiB. The exports kept in memory are bounded too; the rest are read again from the disk cache.
MAX_REPO_TAR_BYTES = 512 << 20
MAX_CACHED_REPO_BYTES = 1 << 30


def swe_cache(cache_dir: Path | None = None) -> Path:
    """The SWE part of the cache: sdists, unpacked sources, wheels."""
    d = (cache_dir or default_cache_dir()) / "swe"
    d.mkdir(parents=True, exist_ok=True)
    return d


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_source(
    source: SdistSource | ArchiveSource, cache_dir: Path | None = None, *, max_bytes: int = MAX_SOURCE_BYTES
) -> Path:
    """The source archive's copy in the cache (`<swe cache>/{sdists,archives}/<sha256[:16]>/`), fetched or copied
    once and checked against its sha256. Nothing of it runs on the host (environments/swe/sources.py)."""
    cache = (cache_dir or default_cache_dir()).expanduser()
    if isinstance(source, ArchiveSource):
        # a dataset names the path: the cached copy gets a name safe to put in the Dockerfile and the build's shell
        name = safe_name(source.path.name).lstrip(".") or "archive"
        dest = swe_cache(cache) / "archives" / source.sha256[:16] / name
        with open_archive(source, max_bytes) as (f, size):
            if _cached(dest, source.sha256):
                return dest
            with file_lock(cache / "locks", f"archive-{source.sha256[:16]}"):
                if not _cached(dest, source.sha256):
                    copy_archive(source, f, size, dest)
        return dest
    dest = swe_cache(cache) / "sdists" / source.sha256[:16] / source.filename
    if _cached(dest, source.sha256):
        return dest
    with file_lock(cache / "locks", f"sdist-{source.sha256[:16]}"):
        if not _cached(dest, source.sha256):
            fetch_sdist(source, dest, max_bytes=max_bytes)
            log.info("fetched %s (%s)", dest.name, source.sha256[:12])
    return dest


def _cached(path: Path, sha256: str) -> bool:
    return path.is_file() and sha256_file(path) == sha256


def environment_image(
    client: docker.DockerClient, spec: EnvironmentSpec, *, base: str | None = None, cache_dir: Path | None = None
) -> str:
    """The environment tier: the base image, fixed environment variables, and the dependencies (pinned wheels for
    the image's CPython, downloaded on the host, unpacked into /opt/swe/site on PYTHONPATH-free sys.path)."""
    base_tag = base or ensure_base_image(client, cache_dir=cache_dir)
    lines = [f"FROM {base_tag}", *(f"ENV {k}={v}" for k, v in sorted(IMAGE_ENV.items()))]
    context: dict[str, bytes | Path] = {}
    if spec.requirements:
        cache = cache_dir or default_cache_dir()
        key = hashlib.sha256("\n".join(spec.requirements).encode()).hexdigest()[:16]
        site = fetch_site(list(spec.requirements), swe_cache(cache) / "site" / key, cache, python_version=spec.python)
        context["site"] = site
        # a .pth file in the interpreter's own dist-packages puts the site on sys.path for every python3 run
        context["swe-site.pth"] = f"{SITE_DIR}\n".encode()
        lines += [f"COPY site {SITE_DIR}", "COPY swe-site.pth /usr/lib/python3/dist-packages/swe-site.pth"]
    return build_image(
        client,
        name="swe/env",
        dockerfile="\n".join(lines) + "\n",
        context_files=context,
        labels={"envfleet.swe.tier": "environment"},
        cache_dir=cache_dir,
    )


def image_name(instance_id: str) -> str:
    """The image repository name of an instance (lowercase, docker-safe)."""
    return "swe/" + (re.sub(r"[^a-z0-9]+", "-", instance_id.lower()).strip("-") or "instance")


def instance_image(
    client: docker.DockerClient,
    instance: SweInstance,
    *,
    env_image: str | None = None,
    cache_dir: Path | None = None,
) -> str:
    """The instance tier: the repository at base_commit in /opt/repo, built from the source archive and checked
    against base_commit (the build fails when the snapshot's hash differs)."""
    source = instance.source
    if isinstance(source, ImageSource):
        if not source.image.startswith(SWE_IMAGE_PREFIX):
            raise InvalidRequestError(
                f"{instance.instance_id}: image {echo(source.image)}: only envfleet SWE images ({SWE_IMAGE_PREFIX}...) "
                "may be named by a dataset; tag a prebuilt instance image under that name"
            )
        if not image_exists(client, source.image):
            raise ImageBuildError(f"{instance.instance_id}: prebuilt image {source.image} is missing", step="source")
        return source.image
    return repo_image(
        client,
        name=image_name(instance.instance_id),
        source=source,
        base_commit=instance.base_commit,
        env_image=env_image or environment_image(client, instance.environment, cache_dir=cache_dir),
        labels={"envfleet.swe.tier": "instance", "envfleet.swe.instance": instance.instance_id},
        cache_dir=cache_dir,
    )


def repo_image(
    client: docker.DockerClient,
    *,
    name: str,
    source: SdistSource | ArchiveSource,
    base_commit: str,
    env_image: str,
    labels: dict[str, str],
    cache_dir: Path | None = None,
) -> str:
    """An image FROM `env_image` with the snapshot repository of `source` (plus its setup patch) in /opt/repo; the
    build checks that the snapshot's commit is `base_commit`. The archive lives only in a lower layer, unreachable
    from a container (and the setup patch is removed in the same step that applies it)."""
    archive = fetch_source(source, cache_dir)
    dockerfile = (
        f"FROM {env_image}\n"
        f"COPY source/{archive.name} /opt/swe-build/source/\n"
        "COPY snapshot.py setup.patch /opt/swe-build/\n"
        f"RUN python3 -S /opt/swe-build/snapshot.py --archive /opt/swe-build/source/{archive.name} "
        f"--dest {REPO_DIR} --strip {source.strip_components} --patch /opt/swe-build/setup.patch "
        f"--expect {base_commit} && rm -rf /opt/swe-build\n"
    )
    return build_image(
        client,
        name=name,
        dockerfile=dockerfile,
        context_files={
            f"source/{archive.name}": archive,
            "snapshot.py": _SNAPSHOT,
            "setup.patch": source.setup_patch.encode(),
        },
        labels=labels,
        cache_dir=cache_dir,
        limits=BuildLimits(),  # it unpacks and patches the dataset's archive: task content, bounded like a tenant's
        adds=False,  # COPY, then unpacked by snapshot.py under the build's limits
    )


def ensure_images(
    client: docker.DockerClient,
    instances: Iterable[SweInstance],
    *,
    workers: int = 2,
    cache_dir: Path | None = None,
    on_built: Callable[[SweInstance, str], None] | None = None,
) -> dict[str, str]:
    """Every instance's image tag (built when missing), environment tiers first; `on_built` sees each one."""
    items = list(instances)
    base = ensure_base_image(client, cache_dir=cache_dir)
    envs: dict[EnvironmentSpec, str] = {}
    for inst in items:
        if inst.environment not in envs and not isinstance(inst.source, ImageSource):
            envs[inst.environment] = environment_image(client, inst.environment, base=base, cache_dir=cache_dir)
    # fetch each distinct source once before the parallel builds
    for src in {i.source.sha256: i.source for i in items if not isinstance(i.source, ImageSource)}.values():
        assert not isinstance(src, ImageSource)
        fetch_source(src, cache_dir)

    def one(inst: SweInstance) -> tuple[str, str]:
        tag = instance_image(client, inst, env_image=envs.get(inst.environment), cache_dir=cache_dir)
        if on_built is not None:
            on_built(inst, tag)
        return inst.instance_id, tag

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="swe-build") as pool:
        return dict(pool.map(one, items))


def _strip_first(tar_bytes: bytes) -> bytes:
    """Re-root a `docker cp`-style tar (`repo/...`) at its top folder's content."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as src, tarfile.open(fileobj=out, mode="w") as dst:
        for m in src.getmembers():
            _, _, rest = m.name.partition("/")
            if not rest:
                continue
            m.name = rest
            if m.islnk():
                m.linkname = m.linkname.partition("/")[2]
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    return out.getvalue()


class RepositoryTooLargeError(EnvironmentBroken):
    """An instance's repository is over MAX_REPO_TAR_BYTES: the task's content, so the task cannot run (ENV_ERROR)."""


class RepoTars:
    """Instance repositories as tars rooted at the repository, exported from the instance images (built when
    missing) and kept on disk (`<cache>/swe/repos/<image id>.tar`: an image id names its content) and, the most
    recent up to MAX_CACHED_REPO_BYTES, in memory.
    An export's container carries its owner process and a lease, and every load first removes those whose owner was
    killed during its export (`sweep_exports`)."""

    def __init__(self, client: docker.DockerClient | None = None, *, cache_dir: Path | None = None) -> None:
        self._client = client
        self._cache_dir = cache_dir
        self._tars: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # oldest used first
        self._locks: dict[str, asyncio.Lock] = {}
        self._thread_lock = threading.Lock()

    def client(self) -> docker.DockerClient:
        """The engine (opened on first use)."""
        with self._thread_lock:
            if self._client is None:
                self._client = docker.from_env()
            return self._client

    async def tar(self, instance: SweInstance, env_image: str) -> bytes:
        """The repository at base_commit as a tar rooted at the repository."""
        key = instance.instance_id
        async with self._locks.setdefault(key, asyncio.Lock()):
            data = self._tars.get(key)
            if data is None:
                data = await asyncio.to_thread(self._load, instance, env_image)
                self._tars[key] = data
                while sum(map(len, self._tars.values())) > MAX_CACHED_REPO_BYTES and len(self._tars) > 1:
                    self._tars.popitem(last=False)
            self._tars.move_to_end(key)
            return data

    def _load(self, instance: SweInstance, env_image: str) -> bytes:
        client = self.client()
        # first what killed exports left (their `finally` never ran), whether or not this one needs to export
        try:
            sweep_exports(client)
        except docker.errors.DockerException as e:
            log.warning("could not sweep export containers: %s", e)
        tag = instance_image(client, instance, env_image=env_image, cache_dir=self._cache_dir)
        image_id = str(client.images.get(tag).id).removeprefix("sha256:")
        path = swe_cache(self._cache_dir) / "repos" / f"{image_id[:32]}.tar"
        if path.is_file() and path.stat().st_size <= MAX_REPO_TAR_BYTES:
            return path.read_bytes()
        data = self._export(client, tag)
        write_atomic(path, data)
        return data

    @staticmethod
    def _export(client: docker.DockerClient, tag: str) -> bytes:
        labels = export_labels(Owner.current(EXPORT_OWNER))
        container = client.containers.create(tag, command=["true"], labels=labels)
        stream = None
        try:
            stream, _ = container.get_archive(REPO_DIR)
            chunks, size = [], 0
            for chunk in stream:
                size += len(chunk)
                if size > MAX_REPO_TAR_BYTES:
                    raise RepositoryTooLargeError(
                        f"the repository of {tag} is over {MAX_REPO_TAR_BYTES >> 20} MiB as a tar; a task's repository "
                        "must be smaller"
                    )
                chunks.append(chunk)
            return _strip_first(b"".join(chunks))
        finally:
            if stream is not None:
                stream.close()  # an export cut short: its connection goes now, not when collected
            container.remove(force=True)


def export_labels(owner: Owner) -> dict[str, str]:
    """The labels of an export container: the mark, and the owner and lease labels the sandbox sweep reads, so that
    `sweep_exports` judges it as that sweep judges a sandbox. Never `envfleet.managed`: that sweep acts only on
    containers sealed under its socket root's key, which this module does not hold."""
    return {EXPORT_LABEL: "1", **owner_labels(owner, EXPORT_LEASE_S)}


def export_verdict(
    labels: dict[str, str], name: str, created: float, now: float, me: Owner, alive: dict[tuple[str, str], bool]
) -> str:
    """Why export container `name` should go, or '' to keep it: by its owner and lease as a sandbox is judged; by
    its age only when it carries no owner (written before exports did). The age is the engine's `Created` against
    this host's wall clock: a clock set 15 minutes on made a live sibling's export look old, and removed it mid-export
    (an ENV_ERROR for its rollout), where its lease, on the monotonic clock, had not run out."""
    legacy = LABEL_PID not in labels
    return doomed(labels, name, created, now, EXPORT_LEASE_S if legacy else None, me, (), alive)


def sweep_exports(client: docker.DockerClient) -> int:
    """Remove the export containers whose owner process is gone (killed during its export) or whose lease expired,
    by the sandbox sweep's own verdict (sweeper.doomed); returns how many were removed (blocking)."""
    me = Owner.current(EXPORT_OWNER)
    now = time.time()
    alive: dict[tuple[str, str], bool] = {}
    removed = 0
    # an export container is created and never started; a sandbox (managed) is the sandbox sweep's alone
    listed = client.api.containers(all=True, filters={"label": f"{EXPORT_LABEL}=1", "status": ["created", "dead"]})
    for c in listed:
        labels = c.get("Labels") or {}
        if LABEL_MANAGED in labels:
            continue
        name = (c.get("Names") or ["/?"])[0].lstrip("/")
        reason = export_verdict(labels, name, float(c.get("Created", now)), now, me, alive)
        if not reason:
            continue
        log.info("removing export container %s (%s)", name, reason)
        try:
            client.api.remove_container(c["Id"], force=True, v=True)
        except docker.errors.NotFound:
            continue  # another sweep's
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                log.warning("could not remove export container %s: %s", name, e)
            continue
        removed += 1
    return removed
