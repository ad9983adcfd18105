"""A cached `docker build`: the tag is a hash of every build input, so an unchanged image is never rebuilt.

The build runs on the engine's classic builder through the low-level API, with no network, from an in-memory
context; every streamed line goes to a log file, and a failure names the Dockerfile step that failed. A build of
untrusted content runs under BuildLimits: memory (no swap), CPU shares and cores, the disk its layers may take
(disk_guard.py), how much it may print (its log is on this host's disk), and a wall-clock deadline. Past the output
or the deadline the connection is dropped, which makes the engine cancel the build and remove its container.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import logging
import re
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

import docker
import docker.errors
import requests
import urllib3

from orchestrator.backends.docker.sweeper import CONTROL_LABELS
from orchestrator.core.errors import (
    BuildRoomError,
    EngineError,
    ImageBuildError,
    ImageNotOnHostError,
    InvalidRequestError,
)
from orchestrator.images.cache import default_cache_dir, file_lock, image_exists, log_dir_for, safe_name
from orchestrator.images.disk_guard import DiskGuard
from orchestrator.images.gc import collect, engine_disk, mark_used, prune_marks

log = logging.getLogger(__name__)

REPO_PREFIX = "envfleet"
TAIL_LINES = 20
_SPOOL_MAX_BYTES = 64 << 20
_NAME = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")
# a name as above, with a tag or a digest: no '..' segment, nothing the engine's URL router would clean into another
IMAGE_REFERENCE = re.compile(_NAME.pattern[:-1] + r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")
_STEP = re.compile(r"^Step \d+/\d+ : ")
_CONTINUED = re.compile(r"\\[ \t]*\r?\n")
# an untrusted build starts only while the engine's disk would keep this much free past its own disk limit
KEEP_FREE_SHARE = 0.05
KEEP_FREE_MIN_BYTES = 2 << 30
MAX_BUILD_LOGS = 500
BUILD_LOG_BYTES = 1 << 30  # the build logs kept in all (the next build's room included)


@dataclass(frozen=True)
class Executable:
    """A context file's bytes, executable in the image (mode 0755; plain bytes are 0644)."""

    data: bytes


ContextFile = bytes | Executable | Path


@dataclass(frozen=True)
class BuildLimits:
    """What one build may use: what the engine's build API can enforce, plus a wall-clock deadline."""

    memory_mb: int = 2048
    cpu_shares: int = 512  # relative weight (1024: one full share), so builds yield to sandboxes under contention
    cpuset: str | None = None  # e.g. "0-3": the cores a build may run on
    timeout_s: float = 900.0
    disk_mb: int = 10240  # what its layers may add to the engine's disk, every step together (disk_guard.py)
    output_mb: int = 64  # what its steps may print: every line goes to a log file on this host's disk


def _limit_kwargs(limits: BuildLimits | None) -> dict[str, Any]:
    """docker-py build() arguments for the limits (memswap = memory: no swap)."""
    if limits is None:
        return {}
    container_limits: dict[str, Any] = {
        "memory": limits.memory_mb << 20,
        "memswap": limits.memory_mb << 20,
        "cpushares": limits.cpu_shares,
    }
    if limits.cpuset:
        container_limits["cpusetcpus"] = limits.cpuset
    # the HTTP read timeout ends a silent step; the deadline check in _run_build ends a chatty one
    return {"container_limits": container_limits, "timeout": max(1, int(limits.timeout_s))}


def _past_deadline(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


@dataclass(frozen=True)
class _Entry:
    """One regular file of the build context: its path in the context, and its bytes or the host file holding them."""

    path: str
    mode: int
    data: bytes | None = None
    source: Path | None = None

    def open(self) -> IO[bytes]:
        return io.BytesIO(self.data) if self.data is not None else self._source().open("rb")

    def size(self) -> int:
        return len(self.data) if self.data is not None else self._source().stat().st_size

    def _source(self) -> Path:
        assert self.source is not None
        return self.source


def image_key(
    dockerfile: str,
    context_files: Mapping[str, ContextFile],
    buildargs: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> str:
    """The hex sha256 over the Dockerfile, build args, labels and every context file's path, mode and bytes."""
    return _key(dockerfile, _collect(context_files), buildargs or {}, labels or {})


def build_image(
    client: docker.DockerClient,
    *,
    name: str,
    dockerfile: str,
    context_files: Mapping[str, ContextFile],
    buildargs: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
    cache_dir: Path | None = None,
    limits: BuildLimits | None = None,
    made_files: Callable[[], Mapping[str, ContextFile]] | None = None,
    from_images: Collection[str] | None = None,
    adds: bool | None = None,
) -> str:
    """Build `envfleet/<name>:<hash of the inputs, 12 hex; 24 with limits>` unless the engine has it already; return
    the tag.

    `context_files` maps a relative path in the build context to its bytes (0644; `Executable` bytes 0755), or to a
    host file or folder (all files under a folder, recursively, their executable bits kept). `made_files` gives more
    context files that are made from inputs (a compiled binary): called only when the image must be built, and not
    hashed, so the caller puts what they are made from in the key (a label). The build has no network; with
    `limits`, it runs under them (untrusted content).
    `from_images`: the images the Dockerfile reads (FROM and --from, none of its own stages), as the caller's check
    of an untrusted Dockerfile found them: each must be on this host, since the engine would pull a missing one over
    the host network (ImageBuildError says so, and nothing is built); None: a trusted Dockerfile's FROM lines.
    `adds`: whether an untrusted Dockerfile (with `limits`) has ADD, as the caller's parse of it found
    (declarative.dockerfile.adds); None: taken to, and no context file may then be an archive.
    Raises ImageBuildError naming the failing step.
    """
    if not _NAME.match(name):
        raise InvalidRequestError(
            f"image name {name!r} must be lowercase [a-z0-9] words joined by '.', '_', '-' or '/'"
        )
    labs = dict(labels or {})
    _refuse_control_labels(dockerfile, labs)
    entries = _collect(context_files)
    if limits is not None and adds is not False:
        _refuse_added_archives(entries)
    args = dict(buildargs or {})
    # the images it builds FROM are inputs too: FROM envfleet/base:latest names whatever base this engine has now
    # (a new envd), so a cache keyed by the Dockerfile's text alone would hand out an image on the old one
    bases = _base_ids(client, dockerfile) if from_images is None else _present_ids(client, from_images)
    # a tag is trusted on a cache hit: tenants' images (env-<name>, where distinct names share a repository) carry
    # 96 bits of their key, past anyone's search for a collision with another tenant's; 48 would not be
    key = _key(dockerfile, entries, {**args, **bases}, labs)[: 12 if limits is None else 24]
    tag = f"{REPO_PREFIX}/{name}:{key}"
    cache = cache_dir or default_cache_dir()
    # marked before it is looked up: a collection (images/gc.py) on another process then leaves it alone
    mark_used(tag, cache, now=True)
    if image_exists(client, tag):
        log.debug("cache hit: %s", tag)
        _check_image_labels(client, tag)
        return tag
    logs = log_dir or log_dir_for(cache)
    logs.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / "locks", tag):
        if image_exists(client, tag):
            return tag
        with _room(client, limits, cache) if limits is not None else contextlib.nullcontext():
            _prune_logs(logs)
            prune_marks(client, cache)
            log_path = logs / f"{safe_name(name)}-{key}.log"
            started = time.monotonic()
            if made_files is not None:
                entries = entries + _collect(made_files())
            log.info("building %s (%d context files), log %s", tag, len(entries), log_path)
            with tempfile.SpooledTemporaryFile(max_size=_SPOOL_MAX_BYTES) as context:
                _write_context(context, dockerfile, entries)
                context.seek(0)
                _run_build(client, context, tag, args, labs, log_path, limits, bases.values())
        mark_used(tag, cache, now=True)  # before it is looked up, as a cache hit is
        if not image_exists(client, tag):
            raise ImageBuildError(f"building {tag}: the build finished but the image is missing", log_path=log_path)
        _check_image_labels(client, tag)
        log.info("built %s in %.1f s", tag, time.monotonic() - started)
    return tag


# what the engine decompresses when ADD's source is a local file (then unpacks, when a tar header follows): gzip,
# bzip2, xz, zstd, and zstd behind a skippable frame (a first word, little-endian, of 0x184D2A50-5F)
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")


def _archive(head: bytes) -> bool:
    """Whether a file starting with `head` (its first 512 bytes) is one the engine would unpack: compressed, as
    above, or a tar header whose checksum holds (an old V7 tar has no "ustar" magic; Go's reader takes it)."""
    if head.startswith(_COMPRESSED) or int.from_bytes(head[:4].ljust(4, b"\0"), "little") & ~0xF == 0x184D2A50:
        return True
    try:
        tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    except tarfile.HeaderError:  # too short, all zeros, a bad checksum
        return False
    return True


def _refuse_added_archives(entries: Sequence[_Entry]) -> None:
    """An untrusted Dockerfile with ADD and an archive in its context: the engine unpacks an ADDed archive itself, as
    root on the host, outside the build's limits and before the disk guard sees a layer (16 MiB of xz can unpack to
    hundreds of GiB). Which context file an ADD names (globs, folders) is the builder's to resolve: with ADD in the
    Dockerfile, no context file may be an archive."""
    for e in entries:
        with e.open() as f:
            head = f.read(tarfile.BLOCKSIZE)
        if _archive(head):
            raise InvalidRequestError(
                f"context file {e.path!r} is an archive and the Dockerfile uses ADD, which the engine would unpack "
                "outside the build's limits: use COPY (and RUN tar -x, which runs under them)"
            )


def _refuse_control_labels(dockerfile: str, labels: Mapping[str, str]) -> None:
    """A Dockerfile's LABEL lines and the build's labels may not name a label the sandbox sweep reads."""
    named = [k for k in labels if k.lower() in CONTROL_LABELS]
    for line in _CONTINUED.sub(" ", dockerfile).splitlines():
        if line.lstrip().upper().startswith("LABEL"):
            named += sorted(k for k in CONTROL_LABELS if k in line.lower())
    if named:
        raise InvalidRequestError(f"labels {sorted(set(named))} are reserved for envfleet's own sandboxes")


def _check_image_labels(client: docker.DockerClient, tag: str) -> None:
    """The built image may not carry a control label either (from its base, or spelled through an ARG): the image
    is removed and the build refused."""
    labels = (client.api.inspect_image(tag).get("Config") or {}).get("Labels") or {}
    named = sorted(k for k in labels if k.lower() in CONTROL_LABELS)
    if named:
        with contextlib.suppress(docker.errors.APIError):
            client.api.remove_image(tag, force=True)
        raise InvalidRequestError(
            f"image {tag} carries labels {named}, reserved for envfleet's own sandboxes (from its base image?)"
        )


def _check_context_path(path: str) -> str:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or str(p) in (".", "Dockerfile"):
        raise InvalidRequestError(f"context path {path!r} must be relative, without '..', and not 'Dockerfile'")
    return str(p)


def _collect(context_files: Mapping[str, ContextFile]) -> list[_Entry]:
    entries: dict[str, _Entry] = {}
    for rel, item in context_files.items():
        root = _check_context_path(rel)
        if isinstance(item, bytes):
            found = [_Entry(root, 0o644, data=item)]
        elif isinstance(item, Executable):
            found = [_Entry(root, 0o755, data=item.data)]
        elif item.is_dir():
            found = [
                _Entry(f"{root}/{f.relative_to(item).as_posix()}", _mode(f), source=f)
                for f in sorted(item.rglob("*"))
                if f.is_file()
            ]
        elif item.is_file():
            found = [_Entry(root, _mode(item), source=item)]
        else:
            raise InvalidRequestError(f"context file {rel!r}: {item} is neither a file nor a folder")
        for e in found:
            if e.path in entries:
                raise InvalidRequestError(f"context path {e.path!r} is given twice")
            entries[e.path] = e
    return [entries[p] for p in sorted(entries)]


def _mode(path: Path) -> int:
    return 0o755 if path.stat().st_mode & 0o111 else 0o644


_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)", re.IGNORECASE | re.MULTILINE)


def _base_ids(client: docker.DockerClient, dockerfile: str) -> dict[str, str]:
    """The engine's image id of every image the Dockerfile builds FROM (stages of the file itself are skipped)."""
    ids = {}
    for ref in _FROM.findall(dockerfile):
        try:
            ids[f"from:{ref}"] = str(client.images.get(ref).id)
        except (docker.errors.ImageNotFound, docker.errors.APIError):
            continue  # a stage name, or an image the build will refuse with its own message
    return ids


# What the limited builds running in this process may still write (each one's disk_mb): each build's check of the
# disk counts the others', which two at once (a registration's checks run in parallel) took from the floor together.
_reserved_bytes = 0
_reserving = threading.Condition()
# How long a build waits for the others running to end when only their room keeps it from starting: eight checks of
# a registration at once on a disk with room for four failed the other four, where they had only to take turns.
ROOM_WAIT_S = 900.0


@contextlib.contextmanager
def _room(client: docker.DockerClient, limits: BuildLimits, cache: Path | None = None) -> Iterator[None]:
    """Hold a build's disk limit against the floor (_check_room) while it runs, tenants' images least recently used
    removed first to make room (images/gc.py); while the builds running are what keeps it from the room it needs,
    wait for them (ROOM_WAIT_S at most)."""
    global _reserved_bytes
    need = limits.disk_mb << 20
    deadline = time.monotonic() + ROOM_WAIT_S
    while True:
        usage = engine_disk(client)
        if usage is not None and collect(
            client, need + _reserved_bytes, cache_dir=cache, keep_free_bytes=_floor(usage)
        ):
            usage = engine_disk(client)  # read again: images removed meanwhile count
        with _reserving:
            try:
                if usage is not None:
                    _check_room(usage, limits, _reserved_bytes)
                _reserved_bytes += need
                break
            except ImageBuildError:
                left = deadline - time.monotonic()
                if not _reserved_bytes or left <= 0:
                    raise
                _check_room(usage, limits, 0)  # alone it would not fit either: no wait makes room
                _reserving.wait(min(left, 5.0))
    try:
        yield
    finally:
        with _reserving:
            _reserved_bytes -= need
            _reserving.notify_all()


def _floor(usage: Any) -> int:
    """What the engine's disk keeps free for sandboxes and the result log past every untrusted build."""
    return max(KEEP_FREE_MIN_BYTES, int(usage.total * KEEP_FREE_SHARE))


def _check_room(usage: Any, limits: BuildLimits, reserved: int) -> None:
    """Refuse a build of untrusted content that could leave the engine's disk with less than a floor free (what
    sandboxes and the result log need to go on), once tenants' images had the chance to make room (images/gc.py).
    `reserved`: what the builds already running may still write."""
    floor = _floor(usage)
    need = floor + (limits.disk_mb << 20) + reserved
    if usage.free < need:
        running = f" and the builds running may write {reserved >> 20} MB" if reserved else ""
        raise BuildRoomError(
            f"the engine's disk has {usage.free >> 20} MB free: a build that may write {limits.disk_mb} MB{running} "
            f"would leave less than the {floor >> 20} MB kept free for sandboxes, tenants' images that no "
            "container uses and that were not used in the last 10 minutes removed first; builds wait until "
            "sandboxes end or an operator frees the engine's disk"
        )


def _prune_logs(logs: Path) -> None:
    """Keep the newest MAX_BUILD_LOGS build logs, BUILD_LOG_BYTES of them at most, with room for the next build's
    (each up to its output_mb): one per build, never removed, they grew without end; by count alone, 500 of 64 MiB
    were 32 GiB of the host's disk, outside the engine's that a build's room is checked against."""
    try:
        found = [(p, p.stat()) for p in logs.glob("*.log")]
    except OSError:
        return
    found.sort(key=lambda entry: entry[1].st_mtime, reverse=True)  # the newest first
    budget = BUILD_LOG_BYTES - (BuildLimits().output_mb << 20)  # with room for the next build's
    total = 0
    for kept, (path, st) in enumerate(found, start=1):
        total += st.st_size
        if kept >= MAX_BUILD_LOGS or total > budget:
            with contextlib.suppress(OSError):
                path.unlink()


def _present_ids(client: docker.DockerClient, refs: Collection[str]) -> dict[str, str]:
    """The engine's image id of each of `refs`; ImageBuildError for one it does not have (a build never pulls)."""
    ids = {}
    for ref in refs:
        try:
            ids[f"from:{ref}"] = str(client.images.get(ref).id)
        except docker.errors.ImageNotFound:
            raise ImageNotOnHostError(
                f"the Dockerfile reads {ref!r}, which is not an image on this host; builds are offline and never "
                "pull one: name an envfleet image this host has (envfleet/base:latest, say)"
            ) from None
        except docker.errors.APIError as e:
            # a reference the engine refuses (4xx) is the Dockerfile's; one it cannot answer for (5xx), the host's
            error = ImageBuildError if e.is_client_error() else ImageNotOnHostError
            raise error(f"the Dockerfile reads {ref!r}, which the engine cannot look up: {e}") from None
    return ids


def _key(dockerfile: str, entries: list[_Entry], buildargs: Mapping[str, str], labels: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    head = {
        "dockerfile": dockerfile,
        "buildargs": dict(sorted(buildargs.items())),
        "labels": dict(sorted(labels.items())),
    }
    h.update(json.dumps(head, sort_keys=True).encode() + b"\n")
    for e in entries:
        content = hashlib.sha256()
        with e.open() as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                content.update(chunk)
        h.update(json.dumps([e.path, e.mode, content.hexdigest()]).encode() + b"\n")
    return h.hexdigest()


def _write_context(out: IO[bytes], dockerfile: str, entries: list[_Entry]) -> None:
    """A deterministic tar of the context: root-owned, mtime 0, Dockerfile first."""
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        data = dockerfile.encode()
        tar.addfile(_tarinfo("Dockerfile", len(data), 0o644), io.BytesIO(data))
        for e in entries:
            with e.open() as f:
                tar.addfile(_tarinfo(e.path, e.size(), e.mode), f)


def _tarinfo(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _run_build(
    client: docker.DockerClient,
    context: IO[bytes],
    tag: str,
    buildargs: dict[str, str],
    labels: dict[str, str],
    log_path: Path,
    limits: BuildLimits | None = None,
    bases: Collection[str] = (),
) -> None:
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    step: str | None = None
    error: str | None = None
    printed = 0  # bytes of output logged
    ended = False  # the engine ended the build itself (a failed step), rather than this process dropping it
    failed: EngineError | None = None  # the engine's own failure, raised once the build's layers are forgotten
    deadline = time.monotonic() + limits.timeout_s if limits is not None else None
    guard = DiskGuard(client, limits.disk_mb, bases) if limits is not None else None
    with log_path.open("w", encoding="utf-8") as logf, guard or contextlib.nullcontext():
        stream: Iterator[dict[str, Any]] | None = None
        try:
            stream = client.api.build(
                fileobj=context,
                custom_context=True,
                tag=tag,
                network_mode="none",
                rm=True,
                forcerm=True,
                pull=False,
                decode=True,
                buildargs=buildargs,
                labels=labels,
                **_limit_kwargs(limits),
            )
            for chunk in stream:
                if _past_deadline(deadline):
                    error = _timed_out(limits)
                    _log_error(logf, tail, error)
                    break
                for line in _lines(chunk):
                    logf.write(line + "\n")
                    printed += len(line.encode()) + 1  # bytes in the log, as output_mb counts them
                    tail.append(line)
                    if _STEP.match(line):
                        step = line
                    if guard is not None:
                        guard.saw(line)
                if "error" in chunk:
                    error, ended = str(chunk["error"] or chunk.get("errorDetail")), True
                    break
                if guard is not None and guard.cut:
                    # past the lines the guard checks, it watches no later step: the build is cancelled now (the
                    # connection dropped), not left to the kill of a step it would no longer see
                    break
                if limits is not None and printed > limits.output_mb << 20:
                    error = (
                        f"the build printed more than {limits.output_mb} MB; it was stopped (send a step's output to "
                        "a file in the image, or to /dev/null)"
                    )
                    _log_error(logf, tail, error)
                    break
            else:
                ended = True
            if guard is not None and guard.over is not None:  # past its disk limit: its steps were killed
                error = guard.over
                _log_error(logf, tail, error)
        except docker.errors.APIError as e:
            if e.is_server_error():  # the engine failing (its disk full, a commit failing), not the Dockerfile
                _log_error(logf, tail, str(e.explanation or e))
                failed = EngineError(f"building {tag}: the engine failed: {e.explanation or e}")
                failed.__cause__ = e
            else:
                error = str(e.explanation or e)
                _log_error(logf, tail, error)
        except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError) as e:
            if limits is None or not _read_timed_out(e):
                # the engine went away mid-build (restarted, the connection reset): the fleet's failure
                failed = EngineError(f"building {tag}: the engine did not answer: {e}")
                failed.__cause__ = e
            else:
                error = _timed_out(limits)  # the read timeout: a step printed nothing until the deadline
                _log_error(logf, tail, error)
        finally:
            _drop(stream)  # closing the connection is what cancels a build the engine is still running
    if (error is not None or failed is not None) and guard is not None:
        # a failed build's layers would stay as untagged images, on disk: the engine's failures' too
        guard.forget(cancelled=not ended)
    if failed is not None:
        raise failed
    if error is not None:
        where = f" at {step!r}" if step else ""
        raise ImageBuildError(
            # the log's name, not its path: the message goes to the tenant, the path is the operator's (log_path)
            f"building {tag} failed{where}: {error.strip()}\n--- last log lines ({log_path.name}) ---\n"
            + "\n".join(tail),
            log_path=log_path,
            step=step,
        )


def _read_timed_out(e: BaseException) -> bool:
    """Whether a transport error is the stream's read timeout (requests wraps urllib3's in a ConnectionError)."""
    seen: BaseException | None = e
    for _ in range(8):  # a chain is a few deep; a cycle must not hold the build
        if seen is None:
            break
        if isinstance(seen, requests.exceptions.ReadTimeout | urllib3.exceptions.ReadTimeoutError | TimeoutError):
            return True
        seen = next((a for a in seen.args if isinstance(a, BaseException)), None) or seen.__cause__ or seen.__context__
    return False


def _log_error(logf: IO[str], tail: collections.deque[str], error: str) -> None:
    logf.write(f"ERROR: {error}\n")
    tail.append(f"ERROR: {error}")


def _timed_out(limits: BuildLimits | None) -> str:
    # a chatty build is stopped at the deadline; a silent step when it has printed nothing for timeout_s
    limit = limits.timeout_s if limits else 0.0
    return f"the build did not finish within its time limit ({limit:g}s); it was cancelled"


def _drop(stream: Iterator[dict[str, Any]] | None) -> None:
    close = getattr(stream, "close", None)
    if close is not None:
        close()


def _lines(chunk: Mapping[str, Any]) -> list[str]:
    if "stream" in chunk:
        return [s.rstrip("\r") for s in str(chunk["stream"]).split("\n") if s.strip()]
    if "error" in chunk:
        return [f"ERROR: {chunk['error']}"]
    if "status" in chunk:
        return [" ".join(str(chunk[k]) for k in ("id", "status", "progress") if chunk.get(k))]
    return [json.dumps(chunk, sort_keys=True)]
