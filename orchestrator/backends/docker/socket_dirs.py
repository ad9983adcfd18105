"""envd's socket directories on the host: one per sandbox, under a root that only this host user can enter.

Everything here treats the sandbox as hostile. The root (0700, owned by us) is created or checked without following
a link; a sandbox's directory is named by the backend (`envfleet-` and 12 hex digits), never by a label; it is a
size-capped tmpfs, so nothing a sandbox writes there lands on the host's disk; once envd's socket is in place the
directory is handed to us (root-owned, 0755), so the sandbox can no longer add, swap or remove anything in it, and
only then is the socket checked (lstat: a socket, not a link) and connected to. Removal never follows a link either.

A per-root secret key seals each container's name (an HMAC in a label): the sweep acts only on containers whose seal
it can verify, so a label copied from an image or set by anyone else is a claim it ignores.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import hmac
import logging
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from orchestrator.core.errors import ConfigError, LimitNotAppliedError

log = logging.getLogger(__name__)

NAME = re.compile(r"^envfleet-[0-9a-f]{12}$")
SOCKET_NAME = "envd.sock"
TOKEN_NAME = "token"  # written by the host before the container starts; envd reads and removes it first thing
KEY_FILE = ".seal-key"
# envd needs one socket; 64 KiB and a few inodes leave room for nothing else
TMPFS_SIZE = "64k"
TMPFS_INODES = 16

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_NOSYMFOLLOW = 2, 4, 8, 256
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8
_libc = ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path: Path, options: str) -> None:
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOSYMFOLLOW
    for f in (flags, flags & ~_MS_NOSYMFOLLOW):  # MS_NOSYMFOLLOW needs Linux 5.10
        if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", f, options.encode()) == 0:
            return
        err = ctypes.get_errno()
        if err != errno.EINVAL:
            break
    raise OSError(err, os.strerror(err), str(path))


def _unmount(path: Path) -> None:
    if _libc.umount2(os.fsencode(path), _MNT_DETACH | _UMOUNT_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point
            log.warning("could not unmount %s: %s", path, os.strerror(err))


class SocketDirs:
    """The socket root of one backend and the per-sandbox directories in it."""

    def __init__(self, root: Path, *, tmpfs: bool = True) -> None:
        self.root = Path(os.path.abspath(root))
        self.tmpfs = tmpfs
        self._ensure_root()
        self._key = self._load_key()

    def _ensure_root(self) -> None:
        """Create the root 0700 (or check it): a real directory, ours, entered by nobody else."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.root, 0o700)
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            raise ConfigError(f"socket root {self.root} is not a directory (a link?): {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise ConfigError(f"socket root {self.root} belongs to uid {st.st_uid}, not to us ({os.geteuid()})")
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)

    def _load_key(self) -> bytes:
        """The root's secret (created once, 0600); a link in its place is refused."""
        path = self.root / KEY_FILE
        with contextlib.suppress(FileNotFoundError):
            return self._read_key(path)
        tmp = self.root / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_bytes(32))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic: a backend starting at the same moment reads the same key
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        return self._read_key(path)

    @staticmethod
    def _read_key(path: Path) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            key = os.read(fd, 64)
        finally:
            os.close(fd)
        if len(key) != 32:
            raise ConfigError(f"{path} is not a 32-byte key")
        return key

    def path(self, name: str) -> Path:
        """The directory of sandbox `name` (a name this backend made; anything else is refused)."""
        if not NAME.match(name):
            raise ValueError(f"not a sandbox name: {name!r}")
        return self.root / name

    def seal(self, name: str) -> str:
        """The HMAC of a container name under this root's key."""
        return hmac.new(self._key, name.encode(), hashlib.sha256).hexdigest()

    def verify(self, name: str, seal: str) -> bool:
        """Whether a container name and its seal label were written by a backend holding this root's key."""
        return bool(NAME.match(name)) and hmac.compare_digest(self.seal(name), seal)

    def make(self, name: str, uid: int, gid: int) -> Path:
        """A fresh directory for sandbox `name`, writable by the sandbox user until `lock`."""
        path = self.path(name)
        os.mkdir(path, 0o700)
        if self.tmpfs:
            options = f"size={TMPFS_SIZE},nr_inodes={TMPFS_INODES},mode=0700,uid={uid},gid={gid}"
            try:
                _mount_tmpfs(path, options)
            except OSError as e:
                os.rmdir(path)
                raise LimitNotAppliedError(
                    f"could not mount a size-capped tmpfs on {path}: {e.strerror} (the backend needs CAP_SYS_ADMIN "
                    "for it; socket_tmpfs=false leaves envd's directory uncapped until envd is ready)"
                ) from e
            return path
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
        return path

    def put_token(self, name: str, token: str, uid: int, gid: int) -> None:
        """Leave envd's token in the directory, readable by the sandbox user only, before the container starts."""
        fd = os.open(self.path(name), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            tfd = os.open(TOKEN_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400, dir_fd=fd)
            try:
                os.write(tfd, token.encode())
                os.fchown(tfd, uid, gid)
            finally:
                os.close(tfd)
        finally:
            os.close(fd)

    def token_taken(self, name: str) -> bool:
        """Whether envd removed its token file (it does so before it listens)."""
        try:
            os.lstat(self.path(name) / TOKEN_NAME)
        except FileNotFoundError:
            return True
        return False

    def lock(self, name: str) -> bool:
        """Take the directory from the sandbox (ours, 0755) and say whether envd's socket is there, a real socket."""
        fd = os.open(self.path(name), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchown(fd, os.geteuid(), os.getegid())
            os.fchmod(fd, 0o755)
            # from here on the sandbox cannot swap the entry: what lstat sees now is what a connect reaches
            return stat.S_ISSOCK(os.lstat(SOCKET_NAME, dir_fd=fd).st_mode)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)

    def has_socket(self, name: str) -> bool:
        """Whether envd's socket is in place (lstat: a link there is no socket)."""
        try:
            return stat.S_ISSOCK(os.lstat(self.path(name) / SOCKET_NAME).st_mode)
        except FileNotFoundError:
            return False

    def remove(self, name: str) -> None:
        """Unmount and delete a sandbox's directory; a link in its place is removed, never followed."""
        path = self.path(name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return
        _unmount(path)
        # rmtree works from directory fds and never follows a link inside the tree
        shutil.rmtree(path, ignore_errors=True)

    def names(self) -> list[str]:
        """The sandbox directories in the root (other entries, the key among them, are left alone)."""
        with os.scandir(self.root) as it:
            return [e.name for e in it if NAME.match(e.name)]

    def age_s(self, name: str, now: float) -> float:
        """Seconds since a directory (or whatever is in its place) last changed, never following a link."""
        return now - os.lstat(self.path(name)).st_mtime
