"""envd's socket directories on the host: one per sandbox, under a root that only this host user can enter.

Everything here treats the sandbox as hostile. The root (0700, owned by us) is created or checked without following
a link; a sandbox's directory is named by the backend (`envfleet-` and 12 hex digits), never by a label; it is a
size-capped tmpfs, so nothing a sandbox writes there lands on the host's disk; once envd's socket is in place the
directory is handed to us (root-owned, 0755), so the sandbox can no longer add, swap or remove anything in it, and
only then is the socket checked (lstat: a socket, not a link) and connected to. Removal never follows a link either.

A per-root secret key seals each container's name (an HMAC in a label): the sweep acts only on containers whose seal
it can verify, so a label copied from an image or set by anyone else is a claim it ignores. The key is kept outside
the root too (kept_key_path: /var/lib, not the /run of the root, a tmpfs): after a reboot the root is new, and with a
new key the containers from before the reboot, back as exited, were claims no sweep could verify, left for good.

Every backend of the host that shares the root sweeps it, and a create may stall long between its mkdir and its
container (a slow engine). So a create holds an exclusive flock on `NAME.creating` beside its directory (in the root,
out of the sandbox's reach) from before the mkdir until its container exists: a sweep first claims each old directory
by taking that lock without blocking, skips those it cannot (their creator is alive and still creating), and only then
lists the containers, so a directory it removes had no creator alive at the claim and no container after it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import hmac
import logging
import os
import re
import secrets
import shutil
import stat
import subprocess
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.core.errors import ConfigError, LimitNotAppliedError

log = logging.getLogger(__name__)

NAME = re.compile(r"^envfleet-[0-9a-f]{12}$")
CREATING = ".creating"  # NAME + this: the lock a create holds until its container exists
_CREATING_NAME = re.compile(r"^(envfleet-[0-9a-f]{12})\.creating$")
STALE_AFTER_S = 60.0  # a directory younger than this, or with no age to judge, is never taken for an orphan
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


@dataclass
class Claims:
    """Old socket directories a sweep has claimed (SocketDirs.claim_stale): their create locks, held until
    `release` (None: a directory without one)."""

    held: dict[str, int | None] = field(default_factory=dict)

    def release(self) -> None:
        """Drop every lock held."""
        for fd in self.held.values():
            if fd is not None:
                os.close(fd)
        self.held.clear()


def default_key_dir() -> Path:
    """Where the roots' keys outlive a reboot: /var/lib/envfleet/seal-keys for root, else under XDG_STATE_HOME."""
    if os.geteuid() == 0:
        return Path("/var/lib/envfleet/seal-keys")
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "envfleet" / "seal-keys"


def kept_key_path(root: Path, key_dir: Path | None = None) -> Path:
    """The kept copy of the key of socket root `root`, named by the root's path."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(root))).hexdigest()[:24]
    return (key_dir or default_key_dir()) / f"{digest}.key"


def _place(folder: Path, path: Path, key: bytes, *, replace: bool = False) -> None:
    """Write `key` at `path` whole (0600, through a new file in `folder`): linked where none is (the first writer
    wins), or renamed over one (`replace`)."""
    tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if replace:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class SocketDirs:
    """The socket root of one backend and the per-sandbox directories in it."""

    def __init__(self, root: Path, *, tmpfs: bool = True, key_dir: Path | None = None) -> None:
        self.root = Path(os.path.abspath(root))
        self.tmpfs = tmpfs
        self.kept_key = kept_key_path(self.root, key_dir)
        self._creating: dict[str, int] = {}  # name -> the fd of the lock its create holds
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
        """The root's secret (0600; a link in its place is refused): the root's own, else the kept one (the root is
        new after a reboot), else a new one. The root's is kept, so the next boot finds it."""
        path = self.root / KEY_FILE
        try:
            key = self._read_key(path)
        except FileNotFoundError:
            try:
                key = self._read_key(self.kept_key)
            except (OSError, ConfigError) as e:  # none kept (a new host), or none that can be read
                if not isinstance(e, FileNotFoundError):
                    log.warning("the kept seal key %s is not read (%s): a new key", self.kept_key, e)
                key = secrets.token_bytes(32)
            _place(self.root, path, key)  # atomic: a backend starting at the same moment reads the same key
            key = self._read_key(path)
        self._keep(key)
        return key

    def _keep(self, key: bytes) -> None:
        """The key's copy outside the root, written when it differs (a root from before kept keys); a host where it
        cannot be written keeps its key in the root alone, as before."""
        try:
            with contextlib.suppress(FileNotFoundError):
                if self._read_key(self.kept_key) == key:
                    return
            self.kept_key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            _place(self.kept_key.parent, self.kept_key, key, replace=True)
        except (OSError, ConfigError) as e:
            log.warning(
                "the seal key of %s is not kept at %s (%s): after a reboot its sandboxes from before it are not swept",
                self.root,
                self.kept_key,
                e,
            )

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
        """A fresh directory for sandbox `name`, writable by the sandbox user until `lock`, marked as being created
        by this process until `created` (or `remove`)."""
        path = self.path(name)
        lock = self.root / f"{name}{CREATING}"
        lfd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file just made: no one else holds it
            self._creating[name] = lfd
            return self._make_dir(path, uid, gid)
        except BaseException:
            self._creating.pop(name, None)
            os.unlink(lock)
            os.close(lfd)
            raise

    def created(self, name: str) -> None:
        """The create of `name` is over (its container exists, or it failed and was cleaned up): drop its lock."""
        lfd = self._creating.pop(name, None)
        if lfd is None:
            return
        # unlinked before it is unlocked: a sweep that finds neither lock nor container lists the containers after
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / f"{name}{CREATING}")
        os.close(lfd)

    def _make_dir(self, path: Path, uid: int, gid: int) -> Path:
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

    def lock(self, name: str) -> str:
        """Take the directory from the sandbox (ours, 0755); "" when envd's socket is there, a real socket, and
        nothing else, else what is wrong: a folder or file the sandbox made there before stayed its own, writable for
        its whole life (without the tmpfs, on the host's disk)."""
        fd = os.open(self.path(name), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchown(fd, os.geteuid(), os.getegid())
            os.fchmod(fd, 0o755)
            # from here on the sandbox cannot swap the entry: what lstat sees now is what a connect reaches
            if not stat.S_ISSOCK(os.lstat(SOCKET_NAME, dir_fd=fd).st_mode):
                return f"{SOCKET_NAME} was swapped for something that is no socket"
            others = sorted(set(os.listdir(fd)) - {SOCKET_NAME})
            if TOKEN_NAME in others:
                return "envd listens but left its token file readable"
            return f"envd's folder holds more than its socket: {others[:5]}" if others else ""
        except FileNotFoundError:
            return f"{SOCKET_NAME} was removed once it was there"
        finally:
            os.close(fd)

    def has_socket(self, name: str) -> bool:
        """Whether envd's socket is in place (lstat: a link there is no socket)."""
        try:
            return stat.S_ISSOCK(os.lstat(self.path(name) / SOCKET_NAME).st_mode)
        except FileNotFoundError:
            return False

    def remove(self, name: str) -> None:
        """Unmount and delete a sandbox's directory (and its create's lock); a link in its place is removed, never
        followed."""
        path = self.path(name)
        try:
            self._remove_dir(path)
        finally:
            self.created(name)
            with contextlib.suppress(FileNotFoundError):  # a dead creator's, removed by the sweep that claimed it
                os.unlink(self.root / f"{name}{CREATING}")

    @staticmethod
    def _remove_dir(path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return
        _unmount(path)
        # rmtree works from directory fds and never follows a link inside the tree; a tree deeper than Python's
        # recursion (a sandbox's, 3,000 folders down) raised out of it and stopped every sweep there: rm goes on
        try:
            shutil.rmtree(path, ignore_errors=True)
        except RecursionError:
            subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], check=False, capture_output=True)

    def claim_stale(self, now: float, keep: Collection[str]) -> Claims:
        """Directories older than STALE_AFTER_S and not in `keep` whose create is not under way: each one's lock is
        taken without blocking and held until the claims are released, so its creator cannot be alive meanwhile. A
        lock left without its directory (a creator killed before its mkdir) is removed on the way. Blocking."""
        claims = Claims()
        try:
            with os.scandir(self.root) as it:
                entries = [e.name for e in it]
            present = set(entries)
            for entry in entries:
                lock = _CREATING_NAME.match(entry)
                if lock is not None:
                    if lock.group(1) not in present:
                        self._drop_orphan_lock(entry, now)
                    continue
                if not NAME.match(entry) or entry in keep:
                    continue
                try:
                    if self.age_s(entry, now) <= STALE_AFTER_S:
                        continue
                except FileNotFoundError:
                    continue
                claimed, lfd = self._claim(entry)
                if claimed:
                    claims.held[entry] = lfd
        except BaseException:
            claims.release()
            raise
        return claims

    def _claim(self, name: str) -> tuple[bool, int | None]:
        """Whether `name` is claimed, and the fd of its create lock, now ours (None: it has none, made by an older
        version or its create finished). Not claimed: its creator holds the lock."""
        try:
            lfd = os.open(self.root / f"{name}{CREATING}", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return True, None
        except OSError as e:  # a link in our own 0700 root is no lock of ours: leave the directory alone
            log.warning("not sweeping %s: its lock %s%s cannot be opened: %s", name, name, CREATING, e.strerror)
            return False, None
        try:
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lfd)
            log.debug("not sweeping %s: its create is under way in a live process", name)
            return False, None
        except BaseException:
            os.close(lfd)
            raise
        return True, lfd

    def _drop_orphan_lock(self, entry: str, now: float) -> None:
        path = self.root / entry
        try:
            if now - os.lstat(path).st_mtime <= STALE_AFTER_S:
                return  # a create between its lock and its mkdir, most likely
            lfd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except OSError:
            pass  # held by a live creator, or gone already
        finally:
            os.close(lfd)

    def names(self) -> list[str]:
        """The sandbox directories in the root (other entries, the key among them, are left alone)."""
        with os.scandir(self.root) as it:
            return [e.name for e in it if NAME.match(e.name)]

    def age_s(self, name: str, now: float) -> float:
        """Seconds since a directory (or whatever is in its place) last changed, never following a link."""
        return now - os.lstat(self.path(name)).st_mtime
