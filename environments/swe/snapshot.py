"""A repository snapshot with no history: an archive unpacked, a setup patch applied, and one root commit whose hash
is fixed by the content alone (fixed author, committer, dates and message).

Standard library only: the same file runs on the host (the dataset builder computes `base_commit` from a tree
without git) and inside the instance image's build (`python3 snapshot.py ...` builds /opt/repo with git and checks
that git's hash is the one computed here). The repository has one branch, one commit, no tags, no reflog, no hooks:
nothing in it can reveal a later state of the code.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

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


class SnapshotError(Exception):
    """The archive is unsafe, or git disagrees with the computed hashes."""


def _safe_parts(name: str, strip: int) -> tuple[str, ...] | None:
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts:
        raise SnapshotError(f"unsafe member path {name!r}")
    parts = tuple(p for p in path.parts if p not in ("", "."))
    if len(parts) <= strip:
        return None
    return parts[strip:]


def _write(dest: Path, parts: tuple[str, ...], data: bytes, executable: bool) -> None:
    out = dest.joinpath(*parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    out.chmod(0o755 if executable else 0o644)


def extract_archive(archive: Path, dest: Path, strip: int = 1) -> None:
    """Unpack a .tar(.gz/.bz2/.xz) or .zip into dest, dropping `strip` leading folders. Modes are normalized to
    0644 / 0755 (executable when any x bit is set); links inside the tree are kept, anything else is refused."""
    dest.mkdir(parents=True, exist_ok=True)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                parts = _safe_parts(info.filename, strip)
                if parts is None or info.is_dir():
                    continue
                _write(dest, parts, zf.read(info), bool((info.external_attr >> 16) & 0o111))
        return
    with tarfile.open(archive) as tf:
        for member in tf.getmembers():
            parts = _safe_parts(member.name, strip)
            if parts is None or member.isdir():
                continue
            if member.issym():
                target = PurePosixPath(member.linkname)
                inside = PurePosixPath(*parts).parent / target
                if target.is_absolute() or ".." in PurePosixPath(os.path.normpath(str(inside))).parts:
                    raise SnapshotError(f"link {member.name!r} points outside the tree")
                out = dest.joinpath(*parts)
                out.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(member.linkname, out)
            elif member.isfile():
                f = tf.extractfile(member)
                assert f is not None
                _write(dest, parts, f.read(), bool(member.mode & 0o111))
            elif member.islnk():
                raise SnapshotError(f"hard link {member.name!r} is not supported")


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
