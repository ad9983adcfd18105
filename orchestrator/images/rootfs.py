"""The root filesystem image every envfleet image starts from, built offline with debootstrap and `docker import`.

No registry is needed: debootstrap fetches .debs from a Debian mirror, and the tree is imported as a one-layer image
tagged by a hash of its inputs, so it is built once per (suite, packages, mirror).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import docker
import docker.errors

from orchestrator.core.errors import ImageBuildError, InvalidRequestError
from orchestrator.images.cache import default_cache_dir, file_lock, image_exists, log_dir_for, log_tail, sha256_hex

log = logging.getLogger(__name__)

ROOTFS_REPO = "envfleet/rootfs"
ROOTFS_PACKAGES: tuple[str, ...] = ("python3", "git", "patch", "procps", "python3-pytest")
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
VARIANT = "minbase"
DEBOOTSTRAP_TIMEOUT_S = 1800.0
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
_SUITE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


def rootfs_key(suite: str, packages: Sequence[str], mirror: str) -> str:
    """The hex sha256 of the rootfs build inputs; the tag uses its first 12 characters."""
    doc = {"suite": suite, "packages": sorted(set(packages)), "variant": VARIANT, "mirror": mirror}
    return sha256_hex(json.dumps(doc, sort_keys=True).encode())


def rootfs_tag(
    suite: str = DEFAULT_SUITE, packages: Sequence[str] = ROOTFS_PACKAGES, mirror: str = DEFAULT_MIRROR
) -> str:
    """The tag `ensure_rootfs_image` gives these inputs: `envfleet/rootfs:<key[:12]>`."""
    return f"{ROOTFS_REPO}:{rootfs_key(suite, packages, mirror)[:12]}"


def ensure_rootfs_image(
    client: docker.DockerClient,
    *,
    suite: str = DEFAULT_SUITE,
    packages: Sequence[str] = ROOTFS_PACKAGES,
    mirror: str = DEFAULT_MIRROR,
    log_dir: Path | None = None,
    cache_dir: Path | None = None,
) -> str:
    """Return the tag of the rootfs image for these inputs, building it with debootstrap (about a minute) if missing."""
    _validate(suite, packages, mirror)
    tag = rootfs_tag(suite, packages, mirror)
    if image_exists(client, tag):
        return tag
    cache = cache_dir or default_cache_dir()
    logs = log_dir or log_dir_for(cache)
    logs.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / "locks", tag):
        if image_exists(client, tag):  # another process built it while we waited for the lock
            return tag
        log_path = logs / f"rootfs-{tag.rsplit(':', 1)[1]}.log"
        work = cache / "tmp"
        work.mkdir(parents=True, exist_ok=True)
        _build(client, tag, suite, sorted(set(packages)), mirror, log_path, work)
    return tag


def _validate(suite: str, packages: Sequence[str], mirror: str) -> None:
    if isinstance(packages, str):
        raise InvalidRequestError("packages must be a list of Debian package names, not one string")
    if not _SUITE.match(suite):
        raise InvalidRequestError(f"suite {suite!r} is not a Debian suite name")
    bad = [p for p in packages if not _PACKAGE.match(p)]
    if bad:
        raise InvalidRequestError(f"not Debian package names: {bad}")
    if not mirror.startswith(("http://", "https://", "file://")):
        raise InvalidRequestError(f"mirror {mirror!r} must be an http(s):// or file:// URL")


def _build(
    client: docker.DockerClient,
    tag: str,
    suite: str,
    packages: list[str],
    mirror: str,
    log_path: Path,
    work_parent: Path,
) -> None:
    if os.geteuid() != 0:
        raise ImageBuildError(
            f"building {tag} needs root (debootstrap creates device nodes and chroots)", step="debootstrap"
        )
    if shutil.which("debootstrap") is None:
        raise ImageBuildError(
            f"building {tag} needs debootstrap on the host (apt-get install debootstrap)", step="debootstrap"
        )
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=work_parent))
    target = work / "root"
    started = time.monotonic()
    log.info("building %s: debootstrap %s (%s), log %s", tag, suite, ",".join(packages), log_path)
    try:
        with log_path.open("wb") as logf:
            argv = [
                "debootstrap",
                f"--variant={VARIANT}",
                f"--include={','.join(packages)}",
                suite,
                str(target),
                mirror,
            ]
            _run(argv, logf, tag, log_path, step="debootstrap")
            _slim(target)
            tarball = work / "rootfs.tar"
            _run(
                ["tar", "--numeric-owner", "-C", str(target), "-cf", str(tarball), "."], logf, tag, log_path, step="tar"
            )
            logf.write(f"importing {tarball} as {tag}\n".encode())
            logf.flush()
            _import(client, tarball, tag, log_path)
    finally:
        _remove_tree(work)
    log.info("built %s in %.0f s", tag, time.monotonic() - started)


def _run(argv: list[str], logf: BinaryIO, tag: str, log_path: Path, *, step: str) -> None:
    logf.write(("$ " + " ".join(argv) + "\n").encode())
    logf.flush()
    env = {**os.environ, "LC_ALL": "C", "DEBIAN_FRONTEND": "noninteractive"}
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=DEBOOTSTRAP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        raise ImageBuildError(
            f"building {tag}: {step} timed out after {e.timeout:.0f} s; log {log_path}:\n{log_tail(log_path)}",
            log_path=log_path,
            step=step,
        ) from e
    if proc.returncode != 0:
        raise ImageBuildError(
            f"building {tag}: {step} failed with exit status {proc.returncode}; log {log_path}:\n{log_tail(log_path)}",
            log_path=log_path,
            step=step,
        )


def _slim(target: Path) -> None:
    """Drop what the image never needs: downloaded .debs and apt's package lists (the sandbox has no network)."""
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = target / sub
        if not d.is_dir():
            continue
        for p in d.iterdir():
            if p.is_file() and not p.is_symlink() and p.name != "lock":
                p.unlink()


def _import(client: docker.DockerClient, tarball: Path, tag: str, log_path: Path) -> None:
    repo, _, version = tag.rpartition(":")
    changes = [f"ENV PATH={IMAGE_PATH}", 'CMD ["/bin/bash"]', f"LABEL envfleet.rootfs={version}"]
    try:
        out = client.api.import_image_from_file(str(tarball), repository=repo, tag=version, changes=changes)
    except docker.errors.APIError as e:
        raise ImageBuildError(f"building {tag}: docker import failed: {e}", log_path=log_path, step="import") from e
    text = out if isinstance(out, str) else json.dumps(out)
    with log_path.open("a") as f:
        f.write(text + "\n")
    for line in text.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and msg.get("error"):
            raise ImageBuildError(
                f"building {tag}: docker import failed: {msg['error']}", log_path=log_path, step="import"
            )
    if not image_exists(client, tag):
        raise ImageBuildError(
            f"building {tag}: docker import finished but the image is missing", log_path=log_path, step="import"
        )


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].replace("\\040", " ") for line in f]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)


def _remove_tree(work: Path) -> None:
    """Delete the scratch tree, but never through a mount debootstrap left behind (that would delete host files)."""
    for point in _mounts_under(work):
        subprocess.run(["umount", "-l", point], stdin=subprocess.DEVNULL, capture_output=True, check=False)
    left = _mounts_under(work)
    if left:
        log.warning("leaving %s in place: still mounted: %s", work, left)
        return
    shutil.rmtree(work, ignore_errors=False)
