"""File operations that never follow a symbolic link out of the path they were given.

Every path is checked component by component with lstat: a symbolic link anywhere on the way is refused. Listings
and stat report links as links, and tar downloads store them as links, so a link to /etc/shadow or to a host path
is never read through.

tarfile and tempfile are imported on first use: most sandboxes never move a tar, and every module envd loads is
private memory in each sandbox.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import IO, TYPE_CHECKING, BinaryIO

from envd.errors import InvalidRequestError, NotFoundError, PathError, SymlinkRefusedError, TooLargeError

if TYPE_CHECKING:
    from tempfile import SpooledTemporaryFile

SPOOL_BYTES = 8 << 20
CHUNK_BYTES = 1 << 20


class Kind(Enum):
    """What a directory entry is."""

    FILE = 1
    DIR = 2
    SYMLINK = 3
    OTHER = 4


@dataclass(frozen=True)
class Entry:
    """One file's metadata, from lstat."""

    name: str
    path: str
    kind: Kind
    size: int
    mode: int
    mtime: float
    link_target: str


def resolve(path: str, workspace: str, *, final_may_be_link: bool = False) -> str:
    """Absolute, normalized form of `path` (relative ones start at the workspace), refusing any symlink on the way."""
    if not path:
        raise InvalidRequestError("path is empty")
    if "\x00" in path:
        raise InvalidRequestError("path contains a NUL byte")
    full = os.path.normpath(os.path.join(workspace, path))
    parts = full.split("/")[1:]
    prefix = ""
    for i, part in enumerate(parts):
        if not part:
            continue
        prefix = f"{prefix}/{part}"
        is_last = i == len(parts) - 1
        try:
            st = os.lstat(prefix)
        except FileNotFoundError:
            return full  # the rest does not exist yet; the caller decides whether that is an error
        if stat.S_ISLNK(st.st_mode) and not (is_last and final_may_be_link):
            target = os.readlink(prefix)
            raise SymlinkRefusedError(f"{path}: {prefix} is a symbolic link (-> {target}); envd does not follow links")
    return full


def _entry(path: str, st: os.stat_result) -> Entry:
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        kind, target = Kind.SYMLINK, os.readlink(path)
    elif stat.S_ISDIR(mode):
        kind, target = Kind.DIR, ""
    elif stat.S_ISREG(mode):
        kind, target = Kind.FILE, ""
    else:
        kind, target = Kind.OTHER, ""
    name = os.path.basename(path) or "/"
    return Entry(_text(name), _text(path), kind, st.st_size, stat.S_IMODE(mode), st.st_mtime, _text(target))


def _text(name: str) -> str:
    """A file name as text: a byte that is no UTF-8 (surrogate-escaped by os) is U+FFFD, since a proto string cannot
    carry it, and one such name failed a whole ListDir (INTERNAL, taken on the host for a dead envd)."""
    return os.fsencode(name).decode("utf-8", "replace")


def _lstat(path: str, shown: str) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise NotFoundError(f"{shown}: no such file or directory") from None


def stat_path(path: str, workspace: str) -> Entry:
    """lstat of a path; a final symlink is reported as a link, not followed."""
    full = resolve(path, workspace, final_may_be_link=True)
    return _entry(full, _lstat(full, path))


def list_dir(path: str, workspace: str) -> list[Entry]:
    """The entries of a directory, sorted by name."""
    full = resolve(path, workspace)
    if not stat.S_ISDIR(_lstat(full, path).st_mode):
        raise PathError(f"{path}: not a directory")
    out = []
    with os.scandir(full) as it:
        for de in it:
            out.append(_entry(de.path, de.stat(follow_symlinks=False)))
    return sorted(out, key=lambda e: e.name)


def read_file(path: str, workspace: str, max_bytes: int) -> tuple[bytes, bool]:
    """Up to max_bytes of a regular file, and whether it was longer."""
    full = resolve(path, workspace)
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotFoundError(f"{path}: no such file") from None
    except OSError as e:
        raise PathError(f"{path}: {e.strerror}") from None
    try:
        f = os.fdopen(fd, "rb")
    except BaseException:  # a directory's fd ("Is a directory"): fdopen does not close it, and each call leaked one
        os.close(fd)
        raise
    with f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PathError(f"{path}: not a regular file")
        data = f.read(max_bytes + 1)
    return data[:max_bytes], len(data) > max_bytes


def _make_dirs(full: str, shown: str) -> None:
    prefix = ""
    for part in full.split("/")[1:]:
        prefix = f"{prefix}/{part}"
        try:
            st = os.lstat(prefix)
        except FileNotFoundError:
            os.mkdir(prefix, 0o755)
            continue
        if stat.S_ISLNK(st.st_mode):
            raise SymlinkRefusedError(f"{shown}: {prefix} is a symbolic link; envd does not follow links")
        if not stat.S_ISDIR(st.st_mode):
            raise PathError(f"{shown}: {prefix} is not a directory")


def _open_to_write(full: str, shown: str, mode: int) -> int:
    """A regular file opened to be overwritten, created if missing. O_NONBLOCK: a FIFO planted at the path would
    block the open until a reader came, holding one of envd's few file threads for good (a handful of such calls and
    no file call or Reset of the sandbox would be served again); anything but a regular file is refused."""
    try:
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as e:
        why = "not a regular file" if e.errno == errno.ENXIO else e.strerror  # ENXIO: a FIFO with no reader
        raise PathError(f"{shown}: {why}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PathError(f"{shown}: not a regular file")
    os.ftruncate(fd, 0)
    os.set_blocking(fd, True)
    return fd


def write_file(path: str, workspace: str, content: bytes, mode: int, make_parents: bool) -> None:
    """Create or replace a regular file with `content` and permission bits `mode`."""
    full = resolve(path, workspace)
    parent = os.path.dirname(full)
    if make_parents:
        _make_dirs(parent, path)
    elif not os.path.isdir(parent):
        raise NotFoundError(f"{path}: parent directory {parent} does not exist (set make_parents)")
    fd = _open_to_write(full, path, mode & 0o777)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, mode & 0o777)
        f.write(content)


def _inside(path: str, root: str) -> bool:
    """Whether the normalized absolute `path` is `root` or lies under it ("/" holds every path)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def _member_target(dest: str, name: str) -> str:
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm == ".." or norm.startswith("../"):
        raise InvalidRequestError(f"tar member {name!r} escapes the destination directory")
    return os.path.join(dest, norm)


def spool() -> SpooledTemporaryFile[bytes]:
    """A binary temporary file kept in memory up to SPOOL_BYTES, then on disk."""
    import tempfile

    return tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)


@contextlib.contextmanager
def _complete_tar() -> Iterator[None]:
    """An archive cut short or corrupt past its first member: the upload's own fault (INVALID_ARGUMENT), not the
    unexpected error (UNKNOWN) that the host reads as an unavailable sandbox and retries."""
    import tarfile

    try:
        yield
    except (tarfile.TarError, EOFError) as e:
        raise InvalidRequestError(f"upload is not a complete tar archive: {e}") from None


MAX_TAR_HEADER_BYTES = 1 << 20  # a PAX or GNU long-name header's data, as Go's archive/tar caps it


@functools.cache
def _bounded_tarinfo() -> type:
    """A TarInfo that refuses extension headers over MAX_TAR_HEADER_BYTES: tarfile reads one whole into memory,
    and a header of a few MB of gzip that claimed 2 GiB took envd's memory with it."""
    import tarfile

    extended = {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME}
    extended.add(tarfile.GNUTYPE_LONGLINK)

    class BoundedTarInfo(tarfile.TarInfo):
        def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
            if self.type in extended and self.size > MAX_TAR_HEADER_BYTES:
                raise tarfile.ReadError(f"a tar extension header of {self.size} bytes (at most {MAX_TAR_HEADER_BYTES})")
            return super()._proc_member(tar)  # type: ignore[misc, no-any-return]

    return BoundedTarInfo


def extract_tar(fileobj: IO[bytes], dest_dir: str, workspace: str) -> int:
    """Extract a tar into dest_dir, refusing members that would land, or point, outside it. Returns the file count."""
    import tarfile

    dest = resolve(dest_dir, workspace)
    _make_dirs(dest, dest_dir)
    count = 0
    try:
        tar = tarfile.open(fileobj=fileobj, mode="r|*", tarinfo=_bounded_tarinfo())
    except tarfile.TarError as e:
        raise InvalidRequestError(f"upload is not a tar archive: {e}") from None
    with tar, _complete_tar():
        for m in tar:
            target = _member_target(dest, m.name)
            if target == dest:
                continue
            resolve(os.path.dirname(target), "/")  # a link extracted earlier is never written through
            _make_dirs(os.path.dirname(target), m.name)
            if m.isdir():
                _make_dirs(target, m.name)
                os.chmod(target, (m.mode & 0o777) | 0o700)
            elif m.isfile():
                src = tar.extractfile(m)
                assert src is not None
                try:
                    if os.path.islink(target):
                        os.unlink(target)
                except OSError as e:
                    raise PathError(f"{m.name}: {e.strerror}") from None
                fd = _open_to_write(target, m.name, 0o600)
                with os.fdopen(fd, "wb") as out:
                    while chunk := src.read(CHUNK_BYTES):
                        out.write(chunk)
                    os.fchmod(fd, m.mode & 0o777)
                count += 1
            elif m.issym():
                # where the link points, absolute or relative, is judged on its normalized path: inside the
                # destination or refused (at "/" nothing is outside); a member is never written through a link
                # in any case, by the resolve above
                link_dest = os.path.normpath(os.path.join(os.path.dirname(target), m.linkname))
                if not _inside(link_dest, dest):
                    raise InvalidRequestError(f"tar member {m.name!r} is a link out of the destination ({m.linkname})")
                if os.path.lexists(target):
                    os.unlink(target)
                os.symlink(m.linkname, target)
                count += 1
            elif m.islnk():
                source = _member_target(dest, m.linkname)
                resolve(source, "/")
                os.link(source, target, follow_symlinks=False)
                count += 1
            else:
                raise InvalidRequestError(f"tar member {m.name!r}: devices and fifos are not allowed")
    return count


class _Capped:
    """A file that refuses a write taking it past `cap` bytes (0: no cap): the tar being built stops there."""

    def __init__(self, f: SpooledTemporaryFile[bytes], cap: int, path: str) -> None:
        self._f, self._cap, self._path = f, cap, path

    def write(self, data: bytes) -> int:
        if self._cap and self._f.tell() + len(data) > self._cap:
            raise TooLargeError(f"the archive of {self._path!r} is over max_bytes = {self._cap}")
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell()


def build_tar(path: str, workspace: str, max_bytes: int = 0) -> BinaryIO:
    """A spooled tar of a file or directory tree, links stored as links. The caller closes it. Past `max_bytes`
    (0: no cap) TooLargeError, the tree read no further."""
    import tarfile

    full = resolve(path, workspace, final_may_be_link=True)
    _lstat(full, path)
    out = spool()
    try:
        with tarfile.open(fileobj=_Capped(out, max_bytes, path), mode="w", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            tar.add(full, arcname=os.path.basename(full) or ".", recursive=True)
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out  # type: ignore[return-value]


def iter_chunks(f: BinaryIO) -> Iterator[bytes]:
    """A file's content in CHUNK_BYTES pieces."""
    while chunk := f.read(CHUNK_BYTES):
        yield chunk
