"""Tenants' images are a cache the engine's disk bounds, as the kubelet's image garbage collection bounds a node's.

Every image a tenant's spec or archive builds (a Validate's too) used to stay, so a tenant could fill the engine's
disk with images: every build was then refused for room, and sandboxes lost the disk their layers write to. Before a
tenant's build starts, when the engine's disk with the build's room would be over `high_share` full or short of the
floor builds keep free, tenants' images are removed, least recently used first, until it would be `low_share` full
with the floor free. Never one a container uses (a sandbox, a warm one, a stopped one), one being built (its build's
lock held), one used in the last `min_age_s`, and never an image that is not a tenant's (the base, the SWE images,
an operator's plug-ins' images: their tags have 12 hex digits, a tenant's 24). A removed image is built again, from
the same inputs to the same tag, when it is next needed.

"Used" is a mark in the image cache folder (the monotonic time, so every process on the host reads it): a build, a
cache hit, a resolve and a sandbox's create (once a minute at most a process) make it, and a collection reads it
again just before each removal. A process that resolved an image long ago looks again before it hands the tag out
(ImageResolver, REVERIFY_S), and a sandbox that could not be made because its image is gone makes the next resolve
look again (`note_missing`), whichever process removed it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

from orchestrator.core.processes import boot_id
from orchestrator.images.cache import default_cache_dir, file_lock, lock_held, safe_name

log = logging.getLogger(__name__)

# what a tenant's build is named: envfleet/env-<environment>:<24 hex of its key> (images/build.py)
TENANT_TAG = re.compile(r"^envfleet/env-[a-z0-9._/-]+:[0-9a-f]{24}$")
MARK_EVERY_S = 60.0  # one process marks an image used at most this often
# a resolver hands out an image it found this recently without looking again: well under min_age_s, so an image a
# process used within it has a mark no collection removes
REVERIFY_S = 300.0
MAX_TAGS = 4096  # what this process remembers of the tags it marked, and of those found missing
MAX_MARKS = 1024  # marks kept in the cache folder before those of images the engine no longer has are pruned


@dataclass(frozen=True)
class ImageGC:
    """When tenants' images are removed, and which."""

    high_share: float = 0.85  # a build that would take the engine's disk past this share full starts a collection
    low_share: float = 0.80  # which removes images until the disk, with the build's room, is this share full
    min_age_s: float = 600.0  # an image used (built, found, resolved) this recently is kept
    selects: re.Pattern[str] = field(default=TENANT_TAG)  # the tags a collection may remove


POLICY = ImageGC()

_marked: dict[str, float] = {}  # tag -> when this process last marked it (monotonic)
_missing: set[str] = set()  # tags a sandbox create found gone: the next resolve builds them again
_lock = threading.Lock()


def _marks(cache_dir: Path | None) -> Path:
    return (cache_dir or default_cache_dir()) / "used"


def _locks(marks: Path) -> Path:
    """The cache folder's locks (images/cache.py file_lock), beside its marks: builds hold one a tag."""
    return marks.parent / "locks"


def mark_used(tag: str, cache_dir: Path | None = None, *, now: bool = False) -> None:
    """Mark a tenant's `tag` used (a file under the cache folder holding this boot and the monotonic time): at most
    once a minute a process, unless `now`; another tag is never collected and goes unmarked."""
    if not POLICY.selects.match(tag):
        return
    t = time.monotonic()
    with _lock:
        if not now and t - _marked.get(tag, -MARK_EVERY_S) < MARK_EVERY_S:
            return
        if len(_marked) >= MAX_TAGS:  # a process that saw every tag of a weeks-long fleet: marked again, no harm
            _marked.clear()
        _marked[tag] = t
    path = _marks(cache_dir) / safe_name(tag)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{boot_id()}:{time.monotonic():.0f}")
    except OSError as e:  # a mark is a hint for the order of removal; an image a container uses is never removed
        log.warning("could not mark image %s used (%s): %s", tag, path, e)


def note_missing(tag: str) -> None:
    """A sandbox of a tenant's `tag` could not be made: the image is gone (a collection, an operator)."""
    if not POLICY.selects.match(tag):
        return
    with _lock:
        if len(_missing) >= MAX_TAGS:  # tags no resolver of this process asks for again
            _missing.clear()
        _missing.add(tag)
        _marked.pop(tag, None)


def take_missing(tag: str) -> bool:
    """Whether a sandbox found `tag` gone since the last call for it."""
    with _lock:
        if tag in _missing:
            _missing.discard(tag)
            return True
        return False


def engine_disk(client: docker.DockerClient) -> Any:
    """The disk usage of the engine's data root where it is a path of this host (else None)."""
    try:
        root = str(client.info().get("DockerRootDir") or "")
        return shutil.disk_usage(root) if root else None
    except (docker.errors.APIError, OSError):
        return None


def _idle_s(tag: str, created: int, marks: Path) -> float:
    """How long ago `tag` was last used: by its mark, on the monotonic clock (one clock for every process of this
    boot, which a wall clock set on an hour moves not at all: it made every image look unused, in use or not); a
    mark of another boot by the file's time; no mark (an image from before marks) from when the engine made it.
    A tag being built (its build's lock held: the build may outlast the minimum age) was used just now."""
    if lock_held(_locks(marks), tag):
        return 0.0
    path = marks / safe_name(tag)
    try:
        boot, _, at = path.read_bytes().decode(errors="replace").partition(":")
        if boot and boot == boot_id():
            with contextlib.suppress(ValueError):  # else a mark being written: by its file's time
                return time.monotonic() - float(at)
        return time.time() - path.stat().st_mtime
    except OSError:
        return time.time() - created


def _candidates(client: docker.DockerClient, policy: ImageGC, marks: Path) -> list[tuple[str, int]]:
    """(tag, when the engine made it) of each image a collection may remove, least recently used first."""
    in_use = {c.get("ImageID") for c in client.api.containers(all=True)}
    found: list[tuple[float, str, int]] = []
    for image in client.api.images():
        if image.get("Id") in in_use:
            continue
        created = int(image.get("Created") or 0)
        for tag in image.get("RepoTags") or ():
            if policy.selects.match(tag):
                idle = _idle_s(tag, created, marks)
                if idle > policy.min_age_s:
                    found.append((-idle, tag, created))
    return [(tag, created) for _, tag, created in sorted(found)]


def candidates(client: docker.DockerClient, policy: ImageGC | None = None, cache_dir: Path | None = None) -> list[str]:
    """The tags a collection may remove, least recently used first."""
    return [tag for tag, _ in _candidates(client, policy or POLICY, _marks(cache_dir))]


def collect(
    client: docker.DockerClient,
    need_bytes: int = 0,
    policy: ImageGC | None = None,
    cache_dir: Path | None = None,
    *,
    keep_free_bytes: int = 0,
) -> list[str]:
    """Remove tenants' images, least recently used first, while the engine's disk with `need_bytes` more would be
    past `high_share` full or have less than `keep_free_bytes` free, until it would be `low_share` full with that
    much free; return the tags removed. Each is judged again just before it goes: a process may have used it since
    the list was made (a cache hit, a resolve). One collection at a time on a host; an engine whose disk is not a
    path here (a remote one) is never collected."""
    policy = policy or POLICY

    def short(usage: Any, share: float) -> bool:
        return _full(usage, need_bytes) > share or usage.free - need_bytes < keep_free_bytes

    usage = engine_disk(client)
    if usage is None or not short(usage, policy.high_share):
        return []
    removed: list[str] = []
    marks = _marks(cache_dir)
    with file_lock(_locks(marks), "image-gc"):
        for tag, created in _candidates(client, policy, marks):
            usage = engine_disk(client)
            if usage is None or not short(usage, policy.low_share):
                break
            if _idle_s(tag, created, marks) <= policy.min_age_s:
                continue
            try:
                client.api.remove_image(tag)  # never forced: an image a container took meanwhile stays (409)
            except docker.errors.NotFound:
                continue
            except docker.errors.APIError as e:
                log.info("image collection: %s stays: %s", tag, e.explanation or e)
                continue
            removed.append(tag)
            (marks / safe_name(tag)).unlink(missing_ok=True)
    if removed:
        left = engine_disk(client)
        log.warning(
            "the engine's disk was short of room: removed %d tenants' image(s) used least recently (%s); now %.0f%% "
            "full. Each is built again when it is next needed",
            len(removed),
            ", ".join(removed[:5]) + (", ..." if len(removed) > 5 else ""),
            100 * _full(left, 0) if left is not None else float("nan"),
        )
    return removed


def prune_marks(client: docker.DockerClient, cache_dir: Path | None = None, policy: ImageGC | None = None) -> int:
    """Past MAX_MARKS marks, remove those of images the engine no longer has (a failed build's, one an operator
    removed), older than the minimum age: every build, failed or not, leaves one. Returns how many went."""
    policy = policy or POLICY
    marks = _marks(cache_dir)
    try:
        files = list(marks.iterdir())
    except OSError:
        return 0
    if len(files) <= MAX_MARKS:
        return 0
    present = {safe_name(tag) for image in client.api.images() for tag in image.get("RepoTags") or ()}
    gone = 0
    for path in files:
        with contextlib.suppress(OSError):
            if path.name not in present and time.time() - path.stat().st_mtime > policy.min_age_s:
                path.unlink()
                gone += 1
    return gone


def _full(usage: Any, need_bytes: int) -> float:
    """The share of the disk taken, with `need_bytes` more (free is what is left to write: reserved blocks count)."""
    return 1.0 - (usage.free - need_bytes) / usage.total if usage.total else 0.0
