"""The sweeper: labels on every container, owner liveness, lease expiry, and removal of what dead owners left.

Each container carries labels naming its owner process and lease, so a sweep (at start, periodically, and when the
engine answers again after a stall) removes what a crashed owner left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.core.processes import boot_id, owner_alive, proc_start_time, process_host
from orchestrator.core.sandbox import SandboxSpec

if TYPE_CHECKING:
    from orchestrator.backends.docker.backend import DockerBackend

log = logging.getLogger(__name__)

LABEL_MANAGED = "envfleet.managed"
LABEL_OWNER = "envfleet.owner"
LABEL_INSTANCE = "envfleet.instance"
LABEL_PID = "envfleet.owner_pid"
LABEL_PID_START = "envfleet.owner_start"
LABEL_HOST = "envfleet.host"
LABEL_LEASE = "envfleet.lease_expiry"
# "<boot id>:<time.monotonic() seconds>": the lease on this boot's monotonic clock, which every process of the host
# shares; the wall-clock one above is for a sweep on another boot (the engine's containers outlived a reboot)
LABEL_LEASE_MONOTONIC = "envfleet.lease_monotonic"
LABEL_SOCKET_DIR = "envfleet.socket_dir"  # written by older versions; never read: a label is no host path
LABEL_SEAL = "envfleet.seal"
LABEL_EXPORT = "envfleet.swe.export"  # a SWE repository's export container (environments/swe/images.py sweeps it)
# the labels the sweep reads: no image built from tenant input may carry them (orchestrator/images/build.py)
CONTROL_LABELS = frozenset(
    {LABEL_MANAGED, LABEL_OWNER, LABEL_INSTANCE, LABEL_PID, LABEL_PID_START, LABEL_HOST, LABEL_LEASE, LABEL_SOCKET_DIR}
    | {LABEL_SEAL, LABEL_EXPORT, LABEL_LEASE_MONOTONIC}
)


@dataclass(frozen=True)
class Owner:
    """The identity this backend instance writes into every container's labels."""

    name: str
    instance: str
    pid: int
    start: str
    host: str

    @classmethod
    def current(cls, name: str) -> Owner:
        """This process."""
        pid = os.getpid()
        return cls(name, uuid.uuid4().hex, pid, proc_start_time(pid), process_host())


def labels_for(owner: Owner, spec: SandboxSpec, seal: str) -> dict[str, str]:
    """The labels of a new container: the spec's own (never one of ours), then ours, sealed."""
    return {
        **{k: v for k, v in spec.labels.items() if k not in CONTROL_LABELS},
        LABEL_MANAGED: "1",
        LABEL_INSTANCE: owner.instance,
        **owner_labels(owner, spec.ttl_s),
        LABEL_SEAL: seal,
    }


def owner_labels(owner: Owner, lease_s: float) -> dict[str, str]:
    """The labels `doomed` judges a container's owner and lease by (process, its start, host; the lease `lease_s`
    from now, on the wall clock and on this boot's monotonic one)."""
    return {
        LABEL_OWNER: owner.name,
        LABEL_PID: str(owner.pid),
        LABEL_PID_START: owner.start,
        LABEL_HOST: owner.host,
        LABEL_LEASE: f"{time.time() + lease_s:.0f}",
        LABEL_LEASE_MONOTONIC: f"{boot_id()}:{time.monotonic() + lease_s:.0f}",
    }


def lease_over(labels: Mapping[str, str], now: float) -> bool:
    """Whether a container's lease has run out: on the monotonic clock when it was made on this boot (a wall clock
    set an hour on, or a host resumed from a suspend, expired every sandbox in use at the next sweep, sibling
    workers' too: INFRA_ERRORs, and a cold pool), else on the wall clock (`now`)."""
    boot, _, at = labels.get(LABEL_LEASE_MONOTONIC, "").partition(":")
    if boot and boot == boot_id():
        with contextlib.suppress(ValueError):
            return float(at) < time.monotonic()
    try:
        lease = float(labels.get(LABEL_LEASE, "0"))
    except ValueError:
        return False
    return bool(lease) and lease < now


def doomed(
    labels: Mapping[str, str],
    name: str,
    created: float,
    now: float,
    older_than: float | None,
    owner: Owner,
    known: Collection[str],
    alive: dict[tuple[str, str], bool] | None = None,
) -> str:
    """Why sealed container `name` should be swept, or '' to keep it. `known`: names this instance holds or makes;
    `alive` remembers owners already looked up."""
    if lease_over(labels, now):
        return "lease expired"
    if older_than is not None and now - created > older_than:
        return f"older than {older_than:g}s"
    if labels.get(LABEL_INSTANCE) == owner.instance:
        # ours, but neither alive in our hands nor being created: a removal or a create that the engine
        # finished after we had given up on it (it stalled)
        return "" if name in known else "orphan of this instance"
    if labels.get(LABEL_HOST) != owner.host:
        return ""  # another host's owner: we cannot see its processes
    pid, start = labels.get(LABEL_PID, ""), labels.get(LABEL_PID_START, "")
    if not pid.isdigit():
        return "owner process is gone"
    alive = {} if alive is None else alive
    if (pid, start) not in alive:
        alive[pid, start] = owner_alive(int(pid), start)
    return "" if alive[pid, start] else "owner process is gone"


async def sweep(backend: DockerBackend, older_than: float | None = None) -> int:
    """Remove the sealed containers (and socket directories) whose owner is gone or whose lease expired.

    A container whose name and seal this backend's key cannot verify is left alone, whatever its labels say. A
    socket directory goes when it is old, has no container, and no live process is still creating it.
    """
    engine = backend.engine
    known = backend.known_names()
    # the old socket directories are claimed (their create locks taken) before the containers are listed: a create
    # still under way elsewhere keeps its lock and its directory, and one that ended before the claim has its
    # container in the list
    claims = await asyncio.to_thread(backend.sockets.claim_stale, time.time(), known)
    try:
        containers = await engine.call(engine.api.containers, all=True, filters={"label": f"{LABEL_MANAGED}=1"})
        known |= backend.known_names()  # and what this instance began meanwhile
        # the verdicts hash every name and read /proc for every owner: off the loop, since on a host of a thousand
        # sandboxes under load that took seconds, and every rollout of the process waited meanwhile
        verdicts, listed = await asyncio.to_thread(_judge, backend, containers, time.time(), older_than, known)
        for cid, name, reason in verdicts:
            log.info("sweeping %s (%s)", name, reason)
            own = backend.owned(cid)
            if own is not None:
                await own.close()
            else:
                await backend.discard(cid, name)
        # socket directories without a container or a live creator (one killed between its mkdir and its create)
        stale = [name for name in claims.held if name not in listed]
        if stale:
            await asyncio.to_thread(_remove_dirs, backend, stale)
    finally:
        claims.release()
    return len(verdicts)


def _remove_dirs(backend: DockerBackend, names: list[str]) -> None:
    for name in names:
        log.info("removing socket directory %s (no container, no creator)", name)
        with contextlib.suppress(FileNotFoundError):
            backend.sockets.remove(name)


def _judge(
    backend: DockerBackend,
    containers: list[dict[str, Any]],
    now: float,
    older_than: float | None,
    known: Collection[str],
) -> tuple[list[tuple[str, str, str]], set[str]]:
    """(id, name, reason) of each container to sweep, and the names of all containers listed (blocking)."""
    verdicts: list[tuple[str, str, str]] = []
    listed = set()
    alive: dict[tuple[str, str], bool] = {}  # owner (pid, start) -> alive: a thousand sandboxes have a few owners
    for c in containers:
        labels = c.get("Labels") or {}
        name = (c.get("Names") or ["/?"])[0].lstrip("/")
        listed.add(name)
        if not backend.sockets.verify(name, labels.get(LABEL_SEAL, "")):
            log.debug("not sweeping %s: its labels are not sealed by this socket root's key", name)
            continue
        reason = doomed(labels, name, float(c.get("Created", now)), now, older_than, backend.owner, known, alive)
        if reason:
            verdicts.append((c["Id"], name, reason))
    return verdicts, listed
