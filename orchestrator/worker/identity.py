"""What a fleet's workers know it by across control-plane restarts: a fleet id (names its Ray actors) and the worker
token (lets a worker join). Both live in the data dir, so a control plane restarted on the same data dir is the same
fleet to the workers that outlived the last one; the token file is 0600, or the operator's own file.

A token file that others can read, that is a link, or that is not the caller's own is refused (ConfigError): the
token lets a process receive policy credentials and send back rewards. Deleting the data dir's token file rotates
the token: the next start writes a new one, and a worker that still holds the old one is refused.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.errors import ConfigError

TOKEN_FILE = "worker_token"
FLEET_ID_FILE = "fleet_id"
MIN_TOKEN_CHARS = 32
MAX_TOKEN_CHARS = 512
# what a gRPC metadata value carries as is: printable ASCII, no spaces
TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")
FLEET_ID = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class FleetIdentity:
    """A fleet's id and its worker token."""

    fleet_id: str
    token: str


def fresh_identity() -> FleetIdentity:
    """An identity of this process only (local workers die with their control plane: nothing to persist)."""
    return FleetIdentity(secrets.token_hex(8), secrets.token_urlsafe(32))


def load_identity(data_dir: Path, token_file: Path | None = None) -> FleetIdentity:
    """The fleet identity kept in `data_dir`, created on first use; `token_file` is the operator's token instead of
    the data dir's."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fleet_id = _read_or_create(data_dir / FLEET_ID_FILE, lambda: secrets.token_hex(8), 0o644).strip()
    if not FLEET_ID.fullmatch(fleet_id):
        raise ConfigError(f"{data_dir / FLEET_ID_FILE} is not a fleet id (16 hex digits); delete it to make a new one")
    if token_file is None:
        token = _read_or_create(data_dir / TOKEN_FILE, lambda: secrets.token_urlsafe(32), 0o600)
        path = data_dir / TOKEN_FILE
    else:
        token, path = _read_secret(token_file), token_file
    token = token.strip()
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS or not TOKEN_CHARS.fullmatch(token):
        raise ConfigError(
            f"{path}: a worker token is {MIN_TOKEN_CHARS}-{MAX_TOKEN_CHARS} printable ASCII characters without spaces "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return FleetIdentity(fleet_id, token)


def _read_or_create(path: Path, make: Callable[[], str], mode: int) -> str:
    """The file's text; made atomically first if missing (two control planes starting at once read the same)."""
    with contextlib.suppress(FileNotFoundError):
        return _read_secret(path) if mode == 0o600 else _read_plain(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, f"{make()}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic, and never over a file that appeared meanwhile
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return _read_secret(path) if mode == 0o600 else _read_plain(path)


def _read_plain(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return os.read(fd, 4096).decode("ascii", "replace")
    finally:
        os.close(fd)


def _read_secret(path: Path) -> str:
    """A secret file's text: a regular file of this user's, readable by no one else, not a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symbolic link
        raise ConfigError(f"{path}: cannot open the worker token file ({e.strerror}); it must be a regular file") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: the worker token file must be a regular file")
        if st.st_uid != os.getuid():
            raise ConfigError(f"{path}: the worker token file belongs to uid {st.st_uid}, not to this user")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(
                f"{path}: the worker token file is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"run `chmod 600 {path}`"
            )
        return os.read(fd, MAX_TOKEN_CHARS + 2).decode("ascii", "replace")
    finally:
        os.close(fd)
