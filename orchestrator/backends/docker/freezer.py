"""The cgroup freezer of one container: an idle warm sandbox frozen costs no CPU until it is thawed.

An idle envd is a gRPC server whose C core keeps timer and thread-pool threads that wake every second or so: about
0.3-0.8 ms of CPU per second per sandbox on this project's hosts, so a thousand warm sandboxes burn a fifth of a core
to a core doing nothing. Frozen (every process of the container stopped by the kernel), they cost nothing; a freeze
or a thaw is one write to a cgroup file, a fraction of a millisecond, where `docker pause` and `docker unpause` cost
the engine, containerd and a runc process about 50 ms of CPU together.

The freezer file is found from the container id the engine gave and fixed cgroup roots, never from anything the
container says. Docker does not see this freeze (the container shows as running): SIGKILL still ends a frozen
container (runc thaws a frozen cgroup v1 after the kill; cgroup v2 kills frozen tasks), so a removal or a sweep after
a crash needs nothing from here (tested on cgroup v1), and the sandbox thaws before its own removal anyway.
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

CGROUP_ROOT = "/sys/fs/cgroup"
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")


def _candidates(root: str, cid: str) -> list[tuple[str, bytes, bytes]]:
    """(file, freeze, thaw) for each layout dockerd uses: cgroup v1 or v2, cgroupfs or systemd driver."""
    v1, v2 = os.path.join(root, "freezer"), root
    return [
        (f"{base}/{group}/{name}", freeze, thaw)
        for base, name, freeze, thaw in (
            (v2, "cgroup.freeze", b"1", b"0"),
            (v1, "freezer.state", b"FROZEN", b"THAWED"),
        )
        for group in (f"docker/{cid}", f"system.slice/docker-{cid}.scope")
    ]


class Freezer:
    """Freeze and thaw one container's processes. Not thread-safe (the loop's)."""

    def __init__(self, path: str, freeze: bytes, thaw: bytes) -> None:
        self.path = path
        self._freeze = freeze
        self._thaw = thaw
        self.frozen = False

    @classmethod
    def of(cls, cid: str, root: str = CGROUP_ROOT) -> Freezer | None:
        """The freezer of container `cid` (a full 64-hex id), or None where this host has none that this process
        can write (no cgroup freezer, another layout, or a worker in a container without the host's cgroups)."""
        if not _CONTAINER_ID.fullmatch(cid):
            return None
        for path, freeze, thaw in _candidates(root, cid):
            if os.path.isfile(path) and os.access(path, os.W_OK):
                return cls(path, freeze, thaw)
        return None

    def freeze(self) -> bool:
        """Stop every process of the container; False (and nothing changed) if the kernel refused."""
        if self._write(self._freeze):
            self.frozen = True
        return self.frozen

    def thaw(self) -> bool:
        """Let them run again; False if the kernel refused (the container is likely gone)."""
        if not self.frozen:
            return True
        ok = self._write(self._thaw)
        if ok:
            self.frozen = False
        return ok

    def _write(self, value: bytes) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                os.write(fd, value)
            finally:
                os.close(fd)
        except OSError as e:
            log.debug("cgroup freezer %s: %s", self.path, e)
            return False
        return True
