"""Private temporary directories that outlive a killed owner only until the next sweep.

A control plane keeps its workers' unix socket in one, a worker its unpacked environment archives: `envfleet-KIND-*`
in the temp directory, 0700, with a marker file naming the process that made it (pid, kernel start time, host and
pid namespace). A clean stop removes its own; SIGKILL leaves it, so each control plane and worker sweeps at start.

The temp directory is shared with other accounts, who are hostile: the sweep acts only on a real directory (never a
link, never followed) that this user owns, mode 0700, holding a regular 0600 marker file of ours in the expected
format whose process is gone from this host. Anything else by that name, whoever planted it, is left untouched: no
removal and no chmod. Removal works from directory descriptors and never follows a link inside the tree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from orchestrator.core.processes import owner_alive, proc_start_time, process_host

log = logging.getLogger(__name__)

PREFIX = "envfleet-"
MARKER = ".envfleet-owner"
MAGIC = "envfleet private directory v1"
MAX_MARKER_BYTES = 4096
_KIND = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


def make_private_dir(kind: str, parent: Path | None = None) -> Path:
    """A fresh 0700 directory `envfleet-KIND-*` in `parent` (the temp directory), marked as this process's."""
    if not _KIND.match(kind):
        raise ValueError(f"not a private directory kind: {kind!r}")
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-", dir=parent))
    pid = os.getpid()
    marker = json.dumps({"magic": MAGIC, "pid": pid, "start": proc_start_time(pid), "host": process_host()})
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o700)  # whatever the umask: the sweep takes only 0700 directories for ours
        mfd = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        try:
            os.fchmod(mfd, 0o600)
            os.write(mfd, marker.encode())
        finally:
            os.close(mfd)
    except BaseException:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    os.close(fd)
    return path


def sweep_private_dirs(parent: Path | None = None) -> list[Path]:
    """Remove the private directories in `parent` (the temp directory) whose owner process is gone; returns them.
    Blocking: call it from a thread."""
    where = Path(parent or tempfile.gettempdir())
    try:
        pfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        log.warning("cannot sweep private directories in %s: %s", where, e.strerror)
        return []
    removed = []
    try:
        pst = os.fstat(pfd)
        if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            # others may rename entries here: what was judged might not be what gets removed
            log.warning("not sweeping private directories in %s: others can write there and it is not sticky", where)
            return []
        with os.scandir(pfd) as it:
            names = [e.name for e in it if e.name.startswith(PREFIX)]
        for name in names:
            reason = _stale(pfd, name)
            if not reason:
                continue
            try:
                shutil.rmtree(name, dir_fd=pfd)
            except OSError as e:
                if os.path.lexists(where / name):
                    log.warning("could not remove stale %s: %s", where / name, e)
                continue  # or another sweep removed it at the same moment
            log.info("removed %s (%s)", where / name, reason)
            removed.append(where / name)
    finally:
        os.close(pfd)
    return removed


def _stale(pfd: int, name: str) -> str:
    """Why entry `name` of the directory `pfd` is a private directory of a gone owner, or '' to leave it alone."""
    try:
        st = os.lstat(name, dir_fd=pfd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            return ""  # a link, a file, someone else's, or not made the way we make ours
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
    except OSError:
        return ""  # gone meanwhile, or not ours to enter
    try:
        if not os.path.samestat(st, os.fstat(fd)):
            return ""
        owner = _read_marker(fd)
    finally:
        os.close(fd)
    if owner is None:
        return ""
    pid, start, host = owner
    if host != process_host():
        return ""  # made where we cannot see its owner's processes (another pid namespace)
    if owner_alive(pid, start):
        return ""
    return f"its owner, pid {pid}, is gone"


def _read_marker(dir_fd: int) -> tuple[int, str, str] | None:
    """(pid, start time, host) from a directory's marker, or None when there is no marker of ours."""
    try:
        mfd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        mst = os.fstat(mfd)
        if not stat.S_ISREG(mst.st_mode) or mst.st_uid != os.geteuid() or stat.S_IMODE(mst.st_mode) != 0o600:
            return None
        raw = os.read(mfd, MAX_MARKER_BYTES + 1)
    finally:
        os.close(mfd)
    if len(raw) > MAX_MARKER_BYTES:
        return None
    with contextlib.suppress(ValueError, RecursionError):
        data = json.loads(raw)
        if isinstance(data, dict) and data.get("magic") == MAGIC:
            pid, start, host = data.get("pid"), data.get("start"), data.get("host")
            if isinstance(pid, int) and isinstance(start, str) and start and isinstance(host, str):
                return pid, start, host
    return None
