"""An in-memory filesystem with envd's rules (envd/files.py): relative paths start at the workspace, a symbolic link
is never followed, only the workspace and /tmp are writable (the root filesystem is read-only) and each has a size
cap, tars refuse members that land or point outside their destination.

Small on purpose: a fleet simulation holds thousands of these, so a node is a slotted object and an empty sandbox is
three directories.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
import time
from typing import Literal

from orchestrator.core.errors import (
    InvalidRequestError,
    SandboxFileError,
    SandboxFileNotFoundError,
    SandboxPermissionError,
)
from orchestrator.core.sandbox import FileEntry, escapes

MAX_READ_BYTES = 16 << 20  # envd's default when max_bytes is 0


class _File:
    __slots__ = ("data", "mode", "mtime")

    def __init__(self, data: bytes, mode: int) -> None:
        self.data, self.mode, self.mtime = data, mode, time.time()


class _Dir:
    __slots__ = ("children", "mode", "mtime")

    def __init__(self, mode: int = 0o755) -> None:
        self.children: dict[str, _Node] = {}
        self.mode, self.mtime = mode, time.time()


class _Link:
    __slots__ = ("mtime", "target")

    def __init__(self, target: str) -> None:
        self.target, self.mtime = target, time.time()


_Node = _File | _Dir | _Link


def _size(node: _Node) -> int:
    if isinstance(node, _File):
        return len(node.data)
    if isinstance(node, _Dir):
        return sum(_size(c) for c in node.children.values())
    return 0


class MemoryFS:
    """One sandbox's files. Errors are the ones envd's transport raises, with envd's wording."""

    __slots__ = ("_caps", "_used", "root", "workspace")

    def __init__(self, workspace: str, workspace_bytes: int, tmp_bytes: int) -> None:
        self.root = _Dir()
        self.workspace = posixpath.normpath(workspace)
        self._caps = {self.workspace: workspace_bytes, "/tmp": tmp_bytes}
        self._used = {self.workspace: 0, "/tmp": 0}
        for mount in self._caps:
            self._mkdirs(mount, mount, image=True)

    # -- paths

    def resolve(self, path: str) -> str:
        """The absolute, normalized path (relative ones start at the workspace)."""
        if not path:
            raise InvalidRequestError("path is empty")
        if "\x00" in path:
            raise InvalidRequestError("path contains a NUL byte")
        full = posixpath.normpath(posixpath.join(self.workspace, path))
        return "/" + full.lstrip("/")  # normpath keeps a leading "//"

    def _lookup(self, full: str, shown: str, *, final_may_be_link: bool = False) -> _Node | None:
        """The node at `full`, or None when it (or a parent) does not exist; refuses links on the way."""
        node: _Node = self.root
        prefix = ""
        parts = [p for p in full.split("/") if p]
        for i, part in enumerate(parts):
            if not isinstance(node, _Dir):
                raise SandboxFileError(f"{shown}: {prefix} is not a directory")
            child = node.children.get(part)
            if child is None:
                return None
            prefix = f"{prefix}/{part}"
            if isinstance(child, _Link) and not (i == len(parts) - 1 and final_may_be_link):
                raise SandboxPermissionError(
                    f"{shown}: {prefix} is a symbolic link (-> {child.target}); envd does not follow links"
                )
            node = child
        return node

    def _mount_of(self, full: str, shown: str) -> str:
        for mount in self._caps:
            if full == mount or full.startswith(mount + "/"):
                return mount
        raise SandboxFileError(f"{shown}: Read-only file system")

    def _charge(self, mount: str, delta: int, shown: str) -> None:
        if delta > 0 and self._used[mount] + delta > self._caps[mount]:
            raise SandboxFileError(f"{shown}: No space left on device")
        self._used[mount] += delta

    def _mkdirs(self, full: str, shown: str, *, image: bool = False) -> _Dir:
        """The directory at `full`, made with its parents; only in writable places unless it is the image's."""
        node = self.root
        prefix = ""
        for part in (p for p in full.split("/") if p):
            prefix = f"{prefix}/{part}"
            child = node.children.get(part)
            if child is None:
                if not image:
                    self._mount_of(prefix, shown)
                child = node.children[part] = _Dir()
            if isinstance(child, _Link):
                raise SandboxPermissionError(f"{shown}: {prefix} is a symbolic link; envd does not follow links")
            if not isinstance(child, _Dir):
                raise SandboxFileError(f"{shown}: {prefix} is not a directory")
            node = child
        return node

    def is_dir(self, path: str) -> bool:
        """Whether `path` is an existing directory (reached without links)."""
        try:
            return isinstance(self._lookup(self.resolve(path), path), _Dir)
        except (SandboxFileError, InvalidRequestError):
            return False

    # -- files

    def read(self, path: str, max_bytes: int = 0) -> bytes:
        """Up to max_bytes (0: envd's default) of a regular file."""
        if max_bytes < 0:
            raise InvalidRequestError(f"max_bytes must be >= 0, got {max_bytes}")
        node = self._lookup(self.resolve(path), path)
        if node is None:
            raise SandboxFileNotFoundError(f"{path}: no such file")
        if not isinstance(node, _File):
            raise SandboxFileError(f"{path}: not a regular file")
        return node.data[: max_bytes or MAX_READ_BYTES]

    def write(self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True) -> None:
        """Create or replace a regular file."""
        if mode > 0o7777 or mode < 0:
            raise InvalidRequestError(f"mode {oct(mode)} is not a permission mode")
        full = self.resolve(path)
        parent_path, name = posixpath.split(full)
        if not name:
            raise SandboxFileError(f"{path}: Is a directory")
        mount = self._mount_of(full, path)
        if make_parents:
            parent = self._mkdirs(parent_path, path)
        else:
            found = self._lookup(parent_path, path)
            if not isinstance(found, _Dir):
                raise SandboxFileNotFoundError(
                    f"{path}: parent directory {parent_path} does not exist (set make_parents)"
                )
            parent = found
        old = parent.children.get(name)
        if isinstance(old, _Link):
            raise SandboxPermissionError(f"{path}: {full} is a symbolic link; envd does not follow links")
        if isinstance(old, _Dir):
            raise SandboxFileError(f"{path}: Is a directory")
        self._charge(mount, len(data) - (len(old.data) if old else 0), path)
        parent.children[name] = _File(bytes(data), (mode or 0o644) & 0o777)

    def list(self, path: str) -> list[FileEntry]:
        """A directory's entries, sorted by name; links are reported, not followed."""
        full = self.resolve(path)
        node = self._lookup(full, path)
        if node is None:
            raise SandboxFileNotFoundError(f"{path}: no such file or directory")
        if not isinstance(node, _Dir):
            raise SandboxFileError(f"{path}: not a directory")
        return [self._entry(posixpath.join(full, name), child) for name, child in sorted(node.children.items())]

    @staticmethod
    def _entry(full: str, node: _Node) -> FileEntry:
        kind: Literal["file", "dir", "symlink"]
        if isinstance(node, _File):
            kind, size, mode, target = "file", len(node.data), node.mode, ""
        elif isinstance(node, _Dir):
            kind, size, mode, target = "dir", 4096, node.mode, ""
        else:
            kind, size, mode, target = "symlink", len(node.target), 0o777, node.target
        return FileEntry(posixpath.basename(full) or "/", full, kind, size, mode, node.mtime, target)

    # -- tars

    def upload(self, tar: bytes, dest_dir: str) -> int:
        """Extract a tar into dest_dir (created); members that escape it are refused. Returns the file count."""
        dest = self.resolve(dest_dir)
        mount = self._mount_of(dest, dest_dir)
        self._mkdirs(dest, dest_dir)
        count = 0
        try:
            archive = tarfile.open(fileobj=io.BytesIO(tar), mode="r:*")
        except tarfile.TarError as e:
            raise InvalidRequestError(f"upload is not a tar archive: {e}") from None
        with archive:
            for m in archive:
                if escapes(m.name):
                    raise InvalidRequestError(f"tar member {m.name!r} escapes the destination directory")
                target = posixpath.join(dest, posixpath.normpath(m.name))
                if target == dest:
                    continue
                parent_path, name = posixpath.split(target)
                parent = self._mkdirs(parent_path, m.name)
                old = parent.children.get(name)
                if m.isdir():
                    self._mkdirs(target, m.name).mode = (m.mode & 0o777) | 0o700
                elif m.isfile():
                    src = archive.extractfile(m)
                    data = src.read() if src is not None else b""
                    self._charge(mount, len(data) - (len(old.data) if isinstance(old, _File) else 0), m.name)
                    parent.children[name] = _File(data, m.mode & 0o777)
                    count += 1
                elif m.issym():
                    link_dest = posixpath.normpath(posixpath.join(parent_path, m.linkname))
                    if posixpath.isabs(m.linkname) or not (link_dest == dest or link_dest.startswith(dest + "/")):
                        raise InvalidRequestError(
                            f"tar member {m.name!r} is a link out of the destination ({m.linkname})"
                        )
                    parent.children[name] = _Link(m.linkname)
                    count += 1
                elif m.islnk():
                    source = self._lookup(posixpath.join(dest, posixpath.normpath(m.linkname)), m.name)
                    if not isinstance(source, _File):
                        raise SandboxFileNotFoundError(f"{m.name}: hard link to a missing file {m.linkname}")
                    parent.children[name] = _File(source.data, source.mode)
                    count += 1
                else:
                    raise InvalidRequestError(f"tar member {m.name!r}: devices and fifos are not allowed")
        return count

    def download(self, path: str) -> bytes:
        """A tar of a file or directory tree, links stored as links, named by the path's last component."""
        full = self.resolve(path)
        node = self._lookup(full, path, final_may_be_link=True)
        if node is None:
            raise SandboxFileNotFoundError(f"{path}: no such file or directory")
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            self._add(tar, posixpath.basename(full) or ".", node)
        return out.getvalue()

    def _add(self, tar: tarfile.TarFile, name: str, node: _Node) -> None:
        info = tarfile.TarInfo(name)
        info.mtime = int(node.mtime)
        if isinstance(node, _File):
            info.size, info.mode = len(node.data), node.mode
            tar.addfile(info, io.BytesIO(node.data))
        elif isinstance(node, _Link):
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, node.target, 0o777
            tar.addfile(info)
        else:
            info.type, info.mode = tarfile.DIRTYPE, node.mode
            tar.addfile(info)
            for child_name, child in sorted(node.children.items()):
                self._add(tar, f"{name}/{child_name}", child)

    # -- reset

    def reset(self, seed: str) -> None:
        """Wipe every writable place and restore the workspace from the directory `seed` ('': empty)."""
        seed_node = None
        if seed:
            if not posixpath.isabs(seed):
                raise InvalidRequestError(f"workspace_seed {seed!r} is not an absolute path to a directory")
            seed_node = self._lookup(posixpath.normpath(seed), seed)
            if not isinstance(seed_node, _Dir):
                raise InvalidRequestError(f"workspace_seed {seed!r} is not an absolute path to a directory")
        restored = _copy_dir(seed_node) if isinstance(seed_node, _Dir) else _Dir()
        for mount in self._caps:
            self._mkdirs(mount, mount, image=True).children.clear()
            self._used[mount] = 0
        ws = self._mkdirs(self.workspace, self.workspace, image=True)
        ws.children = restored.children
        self._used[self.workspace] = _size(ws)


def _copy(node: _Node) -> _Node:
    if isinstance(node, _File):
        return _File(node.data, node.mode)
    if isinstance(node, _Link):
        return _Link(node.target)
    return _copy_dir(node)


def _copy_dir(node: _Dir) -> _Dir:
    d = _Dir(node.mode)
    d.children = {name: _copy(child) for name, child in node.children.items()}
    return d
