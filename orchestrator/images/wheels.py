"""envd's private Python dependencies as an unpacked "site" folder, fetched as binary wheels for the image's CPython.

The host's pip downloads manylinux wheels for the image's interpreter (not the host's), so no compiler and no pip is
needed inside the image: the wheels are unpacked here and copied in, to be put on envd's sys.path only.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from orchestrator.core.errors import ImageBuildError
from orchestrator.images.cache import file_lock, log_dir_for, log_tail, sha256_hex

log = logging.getLogger(__name__)

# The CPython of the default rootfs (Debian bookworm's python3).
IMAGE_PYTHON = "3.11"
ENVD_DISTRIBUTIONS = ("grpcio", "protobuf", "grpcio-health-checking")
PIP_TIMEOUT_S = 900.0
_MANYLINUX = ("manylinux_2_28", "manylinux_2_17", "manylinux2014")
# What one wheel may unpack to on this host. A dataset names the distributions (SWE pins), and their publishers make
# the bytes: a zip's members are read at most their declared size, so the declared sizes are what is counted. The
# largest wheels an environment plausibly needs (torch's CPU build: about 1 GiB unpacked) fit; a deflate bomb (a
# 100 MB wheel unpacking to 100 GB) does not, nor a member more than MAX_WHEEL_RATIO times its compressed size past
# the floor.
MAX_WHEEL_BYTES = 4 << 30
MAX_SITE_BYTES = 8 << 30  # every wheel of one site together
MAX_WHEEL_MEMBERS = 200_000
MAX_WHEEL_RATIO = 200
WHEEL_RATIO_FLOOR = 64 << 20
_MACHINES = {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}


def envd_requirements(
    machine: str | None = None,
    python_version: str = IMAGE_PYTHON,
    roots: Sequence[str] = ENVD_DISTRIBUTIONS,
    skip_roots: Sequence[str] | None = None,
) -> list[str]:
    """The runtime dependencies of `roots` (default: envd's) and theirs, pinned to the host's installed versions.

    The roots themselves are left out when they are not plain dependencies (the envfleet distribution, say), or
    as `skip_roots` names.

    Pinning to the host keeps the committed protobuf code and the image's runtime in step; the closure is taken
    over the host's metadata, with markers evaluated for the image's Python and architecture (extras left out).
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    arch = _arch(machine)
    env: dict[str, str] = {  # evaluate() fills the keys not given here from the host
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "implementation_version": f"{python_version}.0",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": arch,
        "extra": "",
    }
    pins: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in pins:
            continue
        try:
            pins[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError as e:
            raise ImageBuildError(f"envd needs {name}, which is not installed on the host", step="wheels") from e
        for text in importlib.metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    leave_out = [r for r in roots if r not in ENVD_DISTRIBUTIONS] if skip_roots is None else skip_roots
    skip = {canonicalize_name(r) for r in leave_out}
    return [f"{name}=={version}" for name, version in sorted(pins.items()) if name not in skip]


def wheel_platforms(machine: str | None = None) -> list[str]:
    """The manylinux platform tags pip may pick for `machine` (default: this host's architecture)."""
    arch = _arch(machine)
    return [f"{tag}_{arch}" for tag in _MANYLINUX]


def _arch(machine: str | None) -> str:
    raw = (machine or platform.machine()).lower()
    arch = _MACHINES.get(raw)
    if arch is None:
        raise ImageBuildError(f"no manylinux wheels for machine {raw!r}", step="pip download")
    return arch


def fetch_site(requirements: list[str], dest: Path, cache_dir: Path, *, python_version: str = IMAGE_PYTHON) -> Path:
    """Download binary wheels for `requirements` (cached by their hash) and unpack them into a folder named by
    `dest` and that hash, `<dest>-<hash>`; return it.

    The folder is written once, under a lock, and never rewritten: a build hashes its context's files, then reads
    them again to send them, and one folder per name, replaced when another install's pins changed the wheels, sent
    the other install's between the two reads, and the image was cached under a key of files it does not hold.
    """
    platforms = wheel_platforms()
    key = _wheels_key(requirements, python_version, platforms)
    wheel_dir = _download(requirements, key, platforms, python_version, cache_dir)
    dest = dest.with_name(f"{dest.name}-{key}")
    marker = dest.parent / f".{dest.name}.key"
    if dest.is_dir() and marker.is_file() and marker.read_text() == key:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / "locks", f"site-{dest.name}"):
        if dest.is_dir() and marker.is_file() and marker.read_text() == key:
            return dest
        wheels = sorted(wheel_dir.glob("*.whl"))
        total = sum(_declared_bytes(w) for w in wheels)
        if total > MAX_SITE_BYTES:
            raise ImageBuildError(
                f"the wheels of {len(wheels)} requirements unpack to {total} bytes, over {MAX_SITE_BYTES}",
                step="unpack wheels",
            )
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            for wheel in wheels:
                unpack_wheel(wheel, staging)
            marker.unlink(missing_ok=True)
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
        marker.write_text(key)
    log.info("unpacked %d wheels into %s", len(wheels), dest)
    return dest


def download_wheels(requirements: list[str], cache_dir: Path, *, python_version: str = IMAGE_PYTHON) -> Path:
    """The folder holding the wheels of `requirements` (downloaded once, cached by their hash under `cache_dir`), as
    `fetch_site` finds it: `wheels/<key>` with its `.complete` list."""
    platforms = wheel_platforms()
    key = _wheels_key(requirements, python_version, platforms)
    return _download(requirements, key, platforms, python_version, cache_dir)


def _wheels_key(requirements: list[str], python_version: str, platforms: list[str]) -> str:
    return sha256_hex(
        json.dumps({"requirements": sorted(requirements), "python": python_version, "platforms": platforms}).encode()
    )[:16]


def _download(requirements: list[str], key: str, platforms: list[str], python_version: str, cache_dir: Path) -> Path:
    wheel_dir = cache_dir / "wheels" / key
    done = wheel_dir / ".complete"
    if done.is_file():
        return wheel_dir
    with file_lock(cache_dir / "locks", f"wheels-{key}"):
        if done.is_file():
            return wheel_dir
        log_path = log_dir_for(cache_dir) / f"wheels-{key}.log"
        wheel_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".wheels-{key}-", dir=wheel_dir.parent))
        abi = "cp" + python_version.replace(".", "")
        argv = [
            sys.executable, "-m", "pip", "download",
            "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
            "--only-binary=:all:", "--no-deps",
            "--python-version", python_version, "--implementation", "cp", "--abi", abi,
            *(arg for p in platforms for arg in ("--platform", p)),
            "-d", str(staging),
            *requirements,
        ]  # fmt: skip
        log.info("downloading wheels for %s into %s", requirements, wheel_dir)
        try:
            with log_path.open("wb") as logf:
                logf.write(("$ " + " ".join(argv) + "\n").encode())
                logf.flush()
                proc = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    timeout=PIP_TIMEOUT_S,
                    env={**os.environ, "PIP_NO_INPUT": "1"},
                )
            if proc.returncode != 0:
                raise ImageBuildError(
                    f"pip download of {requirements} failed with exit status {proc.returncode}; "
                    f"log {log_path}:\n{log_tail(log_path)}",
                    log_path=log_path,
                    step="pip download",
                )
            if wheel_dir.exists():
                shutil.rmtree(wheel_dir)
            staging.rename(wheel_dir)
            done.write_text("\n".join(sorted(p.name for p in wheel_dir.glob("*.whl"))) + "\n")
        except subprocess.TimeoutExpired as e:
            raise ImageBuildError(
                f"pip download of {requirements} timed out; log {log_path}:\n{log_tail(log_path)}",
                log_path=log_path,
                step="pip download",
            ) from e
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    return wheel_dir


def unpack_wheel(wheel: Path, dest: Path) -> None:
    """Install a wheel by unpacking it, `.dist-info` included; `*.data/{purelib,platlib}` go to the top, other `.data`
    is dropped."""
    with zipfile.ZipFile(wheel) as zf:
        _check_sizes(wheel, zf.infolist())
        for info in zf.infolist():
            if info.is_dir():
                continue
            rel = _install_path(info.filename, wheel)
            if rel is None:
                continue
            out = dest.joinpath(*rel.parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            out.chmod(0o755 if mode & 0o111 else 0o644)


def _declared_bytes(wheel: Path) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return sum(i.file_size for i in zf.infolist())
    except zipfile.BadZipFile as e:
        raise ImageBuildError(f"wheel {wheel.name} is not a zip file: {e}", step="unpack wheels") from e


def _check_sizes(wheel: Path, members: list[zipfile.ZipInfo]) -> None:
    total = sum(i.file_size for i in members)
    packed = max(sum(i.compress_size for i in members), 1)
    why = None
    if len(members) > MAX_WHEEL_MEMBERS:
        why = f"has {len(members)} members, over {MAX_WHEEL_MEMBERS}"
    elif total > MAX_WHEEL_BYTES:
        why = f"unpacks to {total} bytes, over {MAX_WHEEL_BYTES}"
    elif total > WHEEL_RATIO_FLOOR and total > MAX_WHEEL_RATIO * packed:
        why = f"unpacks to {total} bytes from {packed}, over {MAX_WHEEL_RATIO} times: refused as a decompression bomb"
    if why is not None:
        raise ImageBuildError(f"wheel {wheel.name} {why}", step="unpack wheels")


def _install_path(name: str, wheel: Path) -> PurePosixPath | None:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ImageBuildError(f"wheel {wheel.name} has an unsafe member path {name!r}", step="unpack wheels")
    top = path.parts[0]
    if top.endswith(".data"):
        if len(path.parts) > 2 and path.parts[1] in ("purelib", "platlib"):
            return PurePosixPath(*path.parts[2:])
        return None
    return path
