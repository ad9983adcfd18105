"""A repository snapshot with no history: an archive unpacked, a setup patch applied, and one root commit whose hash
is fixed by the content alone (fixed author, committer, dates and message).

Standard library only: the same file runs on the host (the dataset builder computes `base_commit` from a tree
without git) and inside the instance image's build (`python3 snapshot.py ...` builds /opt/repo with git and checks
that git's hash is the one computed here). The repository has one branch, one commit, no tags, no reflog, no hooks:
nothing in it can reveal a later state of the code.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import hashlib
import lzma
import os
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, cast

IDENTITY = ("envfleet", "swe@envfleet.invalid")
EPOCH = 946684800  # 2000-01-01T00:00:00Z
MESSAGE = "envfleet snapshot\n"
COMMIT_ENV = {
    "GIT_AUTHOR_NAME": IDENTITY[0],
    "GIT_AUTHOR_EMAIL": IDENTITY[1],
    "GIT_AUTHOR_DATE": f"@{EPOCH} +0000",
    "GIT_COMMITTER_NAME": IDENTITY[0],
    "GIT_COMMITTER_EMAIL": IDENTITY[1],
    "GIT_COMMITTER_DATE": f"@{EPOCH} +0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}
# never versioned: byte code and caches the test runs would leave behind
EXCLUDES = "__pycache__/\n*.py[cod]\n.pytest_cache/\n*.egg-info/\n.eggs/\n"
# Limits of one archive (an archive is untrusted input: a dataset names it): members, unpacked bytes, and unpacked
# bytes per archive byte once past RATIO_FLOOR (a source tree compresses 5-10x; a bomb, 1000x).
MAX_MEMBERS = 300_000
MAX_TOTAL_BYTES = 8 << 30
MAX_RATIO = 200
RATIO_FLOOR = 256 << 20
_COPY_CHUNK = 1 << 20


class SnapshotError(Exception):
    """The archive is unsafe, or git disagrees with the computed hashes."""


class ArchiveLimitError(SnapshotError):
    """The archive is over one of its limits; `limit` names it (members, total_bytes, member_bytes, ratio)."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class ArchiveLimits:
    """Limits of one archive, for a caller stricter than the defaults (a tenant's upload); None: the module's."""

    members: int | None = None
    total_bytes: int | None = None
    member_bytes: int | None = None  # one regular file, unpacked


def _safe_parts(name: str, strip: int) -> tuple[str, ...] | None:
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts:
        raise SnapshotError(f"unsafe member path {name!r}")
    parts = tuple(p for p in path.parts if p not in ("", "."))
    if len(parts) <= strip:
        return None
    return parts[strip:]


def _shown(name: str) -> str:
    return repr(name if len(name) <= 120 else name[:120] + "...")


class _Tree:
    """The destination being built. Every path is resolved against the tree as it stands, links included, so a
    link made earlier (`d/up -> ..`, `d/e -> up/..`) can never carry a later write (`d/e/x`) outside it."""

    def __init__(self, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        self.root = Path(os.path.realpath(dest))
        self._links: list[Path] = []

    def _inside(self, path: str) -> bool:
        return path == str(self.root) or path.startswith(str(self.root) + os.sep)

    def folder(self, parts: tuple[str, ...], name: str) -> Path:
        """The real folder `parts` names in the tree, made where missing; refused when it resolves outside."""
        cur = self.root
        for part in parts:
            nxt = cur / part
            if os.path.islink(nxt):
                real = os.path.realpath(nxt)
                if not self._inside(real) or not os.path.isdir(real):
                    raise SnapshotError(f"member {_shown(name)} would be written through a link out of the tree")
                cur = Path(real)
            elif nxt.is_dir():
                cur = nxt
            elif os.path.lexists(nxt):
                raise SnapshotError(f"member {_shown(name)}: {part!r} is a file, not a folder")
            else:
                nxt.mkdir()
                cur = nxt
        return cur

    def _free(self, out: Path, name: str) -> None:
        """Make room for a member at `out` (a later member replaces an earlier one, as tar does; never a folder)."""
        if os.path.islink(out) or os.path.isfile(out):
            os.unlink(out)  # unlink removes a link itself, never what it points to
        elif os.path.lexists(out):
            raise SnapshotError(f"member {_shown(name)} would replace a folder")

    def write(self, parts: tuple[str, ...], src: IO[bytes], executable: bool, name: str) -> None:
        """A regular file, written without following any link."""
        out = self.folder(parts[:-1], name) / parts[-1]
        self._free(out, name)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            shutil.copyfileobj(src, f, _COPY_CHUNK)
        os.chmod(out, 0o755 if executable else 0o644)

    def link(self, parts: tuple[str, ...], target: str, name: str) -> None:
        """A symbolic link whose target stays inside the tree, both as written and as resolved now."""
        where = PurePosixPath(*parts).parent / target
        if PurePosixPath(target).is_absolute() or ".." in PurePosixPath(os.path.normpath(str(where))).parts:
            raise SnapshotError(f"link {_shown(name)} points outside the tree")
        parent = self.folder(parts[:-1], name)
        if not self._inside(os.path.realpath(parent / target)):
            raise SnapshotError(f"link {_shown(name)} points outside the tree (through another link)")
        out = parent / parts[-1]
        self._free(out, name)
        os.symlink(target, out)
        # a new link can turn an earlier one outward (`d/e -> up/..` made before `d/up -> ..`): check them all
        self._links.append(out)
        outward = [p for p in self._links if os.path.islink(p) and not self._inside(os.path.realpath(p))]
        if outward:
            os.unlink(out)
            self._links.pop()
            raise SnapshotError(f"link {_shown(name)} would make another link point outside the tree")

    def check_links(self) -> None:
        """Every link of the finished tree resolves inside it (a link made before the one it goes through)."""
        for folder, dirs, files in os.walk(self.root):
            for entry in dirs + files:
                path = os.path.join(folder, entry)
                if os.path.islink(path) and not self._inside(os.path.realpath(path)):
                    rel = os.path.relpath(path, self.root)
                    raise SnapshotError(f"link {_shown(rel)} points outside the tree (through another link)")


_CD_HEADER = 46  # a zip central directory header's fixed part


class _Budget:
    """Counts members and unpacked bytes against the archive's limits."""

    def __init__(self, archive: Path, limits: ArchiveLimits | None = None) -> None:
        limits = limits or ArchiveLimits()
        self.archive_bytes = max(archive.stat().st_size, 1)
        self.members = 0
        self.total = 0
        self.max_members = MAX_MEMBERS if limits.members is None else limits.members
        self.max_total = MAX_TOTAL_BYTES if limits.total_bytes is None else limits.total_bytes
        self.max_member = limits.member_bytes

    def check_zip_index(self, archive: Path) -> None:
        """The members of a zip's index (its central directory), counted against the cap before ZipFile reads it whole
        (300,000 empty entries in 24 MiB held 146 MiB, the cap of 10,000 counted only after). Counted header by
        header over the bytes ZipFile reads, where its end record says they are (zipfile's own reader of that record,
        ZIP64 too): the count the record declares may be a lie. An index it cannot find is ZipFile's to refuse."""
        with archive.open("rb") as f:
            end = zipfile._EndRecData(f)  # type: ignore[attr-defined]
            if not end:
                return
            size = end[zipfile._ECD_SIZE]  # type: ignore[attr-defined]
            start = end[zipfile._ECD_LOCATION] - size  # type: ignore[attr-defined]
            if end[zipfile._ECD_SIGNATURE] == zipfile.stringEndArchive64:  # type: ignore[attr-defined]
                start -= zipfile.sizeEndCentDir64 + zipfile.sizeEndCentDir64Locator  # type: ignore[attr-defined]
            if start < 0:
                return
            f.seek(start)
            index = f.read(size)  # at most the archive's own size, which its cap bounds
        at = count = 0
        while at + _CD_HEADER <= len(index) and index[at : at + 4] == b"PK\x01\x02":
            count += 1
            if count > self.max_members:
                raise ArchiveLimitError(f"the archive has more than {self.max_members} members", "members")
            name, extra, comment = struct.unpack_from("<HHH", index, at + 28)
            at += _CD_HEADER + name + extra + comment

    def add(self, size: int, name: str) -> None:
        self.members += 1
        self.total += max(size, 0)
        if self.members > self.max_members:
            raise ArchiveLimitError(f"the archive has more than {self.max_members} members", "members")
        if self.max_member is not None and size > self.max_member:
            raise ArchiveLimitError(
                f"member {_shown(name)} unpacks to {size} bytes, over {self.max_member}", "member_bytes"
            )
        if self.total > self.max_total:
            raise ArchiveLimitError(
                f"the archive unpacks to more than {self.max_total} bytes (at {_shown(name)})", "total_bytes"
            )
        if self.total > RATIO_FLOOR and self.total > MAX_RATIO * self.archive_bytes:
            raise ArchiveLimitError(
                f"the archive unpacks to over {MAX_RATIO} times its size ({self.total} bytes from "
                f"{self.archive_bytes}): refused as a decompression bomb",
                "ratio",
            )


def extract_archive(archive: Path, dest: Path, strip: int = 1, limits: ArchiveLimits | None = None) -> None:
    """Unpack a .tar(.gz/.bz2/.xz) or .zip into dest, dropping `strip` leading folders. Modes are normalized to
    0644 / 0755 (executable when any x bit is set); links that stay inside the tree are kept, anything else is
    refused. Every write is resolved against the tree being built; members, size and ratio are limited (by
    `limits` where given; ArchiveLimitError says which)."""
    tree = _Tree(dest)
    budget = _Budget(archive, limits)
    if zipfile.is_zipfile(archive):
        budget.check_zip_index(archive)
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                budget.add(info.file_size, info.filename)
                parts = _safe_parts(info.filename, strip)
                if parts is None or info.is_dir():
                    continue
                try:
                    src = zf.open(info)  # reads at most file_size bytes, CRC checked
                except (RuntimeError, NotImplementedError) as e:  # encrypted, or a method zipfile does not read
                    raise SnapshotError(f"member {_shown(info.filename)} cannot be read: {e}") from None
                with src:
                    tree.write(parts, src, bool((info.external_attr >> 16) & 0o111), info.filename)
        return
    with _tar_stream(archive, budget) as stream, tarfile.open(fileobj=cast(IO[bytes], stream), mode="r:") as tf:
        for member in tf:  # streamed: a huge member list is refused before it is all read
            budget.add(member.size if member.isfile() else 0, member.name)
            parts = _safe_parts(member.name, strip)
            if parts is None or member.isdir():
                continue
            if member.issym():
                tree.link(parts, member.linkname, member.name)
            elif member.isfile():
                f = tf.extractfile(member)
                assert f is not None
                with f:
                    tree.write(parts, f, bool(member.mode & 0o111), member.name)
            elif member.islnk():
                raise SnapshotError(f"hard link {_shown(member.name)} is not supported")
            else:
                raise SnapshotError(f"member {_shown(member.name)} is a device or fifo; refused")
    tree.check_links()


# A tar's headers are read whole, outside any member: a GNU long name or a pax header of a gigabyte, a few hundred KB
# compressed, was held in memory before a member was counted. Every byte read from the unpacked stream is counted:
# the members' bytes and, for each, its header and padding, and this much for long names and pax records.
HEADER_BYTES = 16 << 20


def _tar_stream(archive: Path, budget: _Budget) -> _Capped:
    """The archive's unpacked tar stream (gzip, bzip2, xz or none, by its magic), read within the budget's bytes."""
    with archive.open("rb") as f:
        magic = f.read(6)
    raw: IO[bytes]
    if magic.startswith(b"\x1f\x8b"):
        raw = cast(IO[bytes], gzip.GzipFile(archive, "rb"))
    elif magic.startswith(b"BZh"):
        raw = cast(IO[bytes], bz2.BZ2File(archive, "rb"))
    elif magic.startswith(b"\xfd7zXZ\x00"):
        raw = cast(IO[bytes], lzma.LZMAFile(archive, "rb"))
    else:
        raw = archive.open("rb")
    return _Capped(raw, budget.max_total + (budget.max_members + 3) * 2 * tarfile.BLOCKSIZE + HEADER_BYTES)


class _Capped:
    """A file's reads, refused (ArchiveLimitError) before one would take the total past `cap` bytes."""

    def __init__(self, raw: IO[bytes], cap: int) -> None:
        self._raw = raw
        self._cap = cap
        self._read = 0

    def read(self, size: int | None = -1) -> bytes:
        left = self._cap - self._read
        if size is not None and size > left:
            raise self._over()
        data = self._raw.read(left + 1 if size is None or size < 0 else size)
        if len(data) > left:
            raise self._over()
        self._read += len(data)
        return data

    def _over(self) -> ArchiveLimitError:
        return ArchiveLimitError(
            f"the archive's tar stream goes on past {self._cap} bytes (a header that large, or a long name)",
            "total_bytes",
        )

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> _Capped:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _object(kind: str, data: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(data)}\0".encode() + data, usedforsecurity=False).digest()


def tree_hash(root: Path, overrides: Mapping[str, bytes] | None = None) -> str:
    """git's tree hash of a folder (as `git add -A -f && git write-tree` would give), `.git` and empty folders
    left out; file content is taken byte for byte. `overrides` replaces the content of existing files (relative
    posix path -> bytes), so a mutant's tree is hashed without copying the folder."""
    digest = _tree(root, root, overrides or {}, top=True)
    if digest is None:
        raise SnapshotError(f"{root} holds no files")
    return digest.hex()


def _tree(root: Path, folder: Path, overrides: Mapping[str, bytes], top: bool = False) -> bytes | None:
    entries: list[tuple[bytes, bytes, bytes]] = []  # (sort key, mode, sha)
    for child in folder.iterdir():
        if top and child.name == ".git":
            continue
        st = child.lstat()
        name = child.name.encode()
        if stat.S_ISLNK(st.st_mode):
            entries.append((name, b"120000", _object("blob", os.readlink(child).encode())))
        elif stat.S_ISDIR(st.st_mode):
            sub = _tree(root, child, overrides)
            if sub is not None:
                entries.append((name + b"/", b"40000", sub))
        elif stat.S_ISREG(st.st_mode):
            mode = b"100755" if st.st_mode & 0o100 else b"100644"
            data = overrides.get(child.relative_to(root).as_posix())
            entries.append((name, mode, _object("blob", child.read_bytes() if data is None else data)))
    if not entries:
        return None
    body = b"".join(mode + b" " + key.rstrip(b"/") + b"\0" + sha for key, mode, sha in sorted(entries))
    return _object("tree", body)


def commit_hash(tree: str) -> str:
    """The hash of the root commit of `tree` with the fixed identity, dates and message."""
    who = f"{IDENTITY[0]} <{IDENTITY[1]}> {EPOCH} +0000"
    body = f"tree {tree}\nauthor {who}\ncommitter {who}\n\n{MESSAGE}".encode()
    return _object("commit", body).hex()


def snapshot_commit(root: Path, overrides: Mapping[str, bytes] | None = None) -> str:
    """`base_commit` of a folder (with `overrides`): the commit hash its snapshot repository will have."""
    return commit_hash(tree_hash(root, overrides))


def _git(repo: Path, *args: str, stdin: bytes | None = None) -> str:
    env = {**os.environ, **COMMIT_ENV}
    proc = subprocess.run(["git", *args], cwd=repo, env=env, input=stdin, capture_output=True, check=False)
    if proc.returncode != 0:
        raise SnapshotError(f"git {' '.join(args)} failed: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout.decode().strip()


def make_repository(archive: Path, dest: Path, strip: int, setup_patch: Path | None, expect: str | None) -> str:
    """Unpack, patch, and commit once; check git's hash against ours (and `expect`); return the commit."""
    extract_archive(archive, dest, strip)
    _git(dest, "init", "-q", "-b", "main")
    info = dest / ".git" / "info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "exclude").write_text(EXCLUDES)
    (info / "attributes").write_text("* -text -ident -filter\n")  # blobs are the bytes, whatever .gitattributes says
    if setup_patch is not None and setup_patch.stat().st_size:
        _git(dest, "apply", "--whitespace=nowarn", str(setup_patch))
    ours = snapshot_commit(dest)
    _git(dest, "add", "-A", "-f", ".")
    tree = _git(dest, "write-tree")
    commit = _git(dest, "commit-tree", tree, stdin=MESSAGE.encode())
    _git(dest, "update-ref", "refs/heads/main", commit)
    if commit != ours:
        raise SnapshotError(f"git made commit {commit} (tree {tree}) but the computed hash is {ours}")
    if expect and commit != expect:
        raise SnapshotError(f"the snapshot is commit {commit}, but base_commit is {expect}")
    for leftover in ("hooks", "logs", "description", "COMMIT_EDITMSG", "ORIG_HEAD"):
        path = dest / ".git" / leftover
        if path.is_dir():
            for sub in sorted(path.rglob("*"), reverse=True):
                sub.rmdir() if sub.is_dir() else sub.unlink()
            path.rmdir()
        elif path.exists():
            path.unlink()
    return commit


def main(argv: list[str] | None = None) -> int:
    """`python3 snapshot.py --archive A --dest D [--strip N] [--patch P] [--expect SHA]`: prints the commit."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--archive", type=Path, required=True)
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--strip", type=int, default=1)
    p.add_argument("--patch", type=Path)
    p.add_argument("--expect")
    args = p.parse_args(argv)
    try:
        commit = make_repository(args.archive, args.dest, args.strip, args.patch, args.expect)
    except SnapshotError as e:
        sys.stderr.write(f"snapshot: {e}\n")
        return 1
    sys.stdout.write(commit + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
