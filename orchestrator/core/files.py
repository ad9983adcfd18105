"""Files written whole or not at all."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# the prefix of write_atomically's temporary copies: a process killed between its write and its rename leaves one,
# which a folder's reader skips and its owner sweeps at the next start (sweep_temporaries)
TEMPORARY_PREFIX = ".tmp-"


def write_atomically(path: Path, data: bytes) -> None:
    """`data` at `path` (its folder must exist), whole or not at all: synced, moved in place, and the move synced, so
    a reader (or a restart after a crash, or a power loss) sees the old file or the new one, never half of one; a
    failure leaves no temporary copy."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMPORARY_PREFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # the rename is the folder's change: synced, a caller's later record (the result log's, synced) never outlives
    # the file it names after a power loss. The file is in place by now: a folder that cannot be synced is logged,
    # not raised (raised, a caller undid nothing of a write that had happened, and the file stayed, unaccounted)
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError as e:
        log.warning("wrote %s, but could not sync its folder: %s", path, e)


def sweep_temporaries(folder: Path) -> int:
    """Remove the temporary copies a killed write_atomically left in `folder`; returns how many."""
    left = [p for p in folder.glob(f"{TEMPORARY_PREFIX}*") if p.is_file() and not p.is_symlink()]
    for path in left:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return len(left)
