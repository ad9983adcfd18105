"""Shared plumbing of the image pipeline: the cache folder, build logs, a cross-process lock, image lookup."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def default_cache_dir() -> Path:
    """The cache root: $ENVFLEET_CACHE, else ~/.cache/envfleet."""
    env = os.environ.get("ENVFLEET_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "envfleet"


def log_dir_for(cache_dir: Path | None) -> Path:
    """The build-log folder under a cache root (created)."""
    d = (cache_dir or default_cache_dir()) / "logs"
    d.mkdir(parents=True, exist_ok=True)
    return d


def safe_name(text: str) -> str:
    """`text` made safe to use as one file name (image tags contain '/' and ':')."""
    return _UNSAFE.sub("_", text).strip("_") or "_"


def _lock_path(lock_dir: Path, name: str) -> Path:
    return lock_dir / f"{safe_name(name)}.lock"


@contextlib.contextmanager
def file_lock(lock_dir: Path, name: str) -> Iterator[None]:
    """Hold an exclusive flock on `lock_dir/<name>.lock`, so two processes never build the same image at once."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    with _lock_path(lock_dir, name).open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def lock_held(lock_dir: Path, name: str) -> bool:
    """Whether a process (this one included) holds `file_lock(lock_dir, name)` now."""
    try:
        with _lock_path(lock_dir, name).open("rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    except FileNotFoundError:
        pass
    return False


def image_exists(client: docker.DockerClient, tag: str) -> bool:
    """True when the engine has an image with this tag."""
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def log_tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file ('' when it is missing)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()
