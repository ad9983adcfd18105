"""The container's HostConfig: every hardening flag and limit of a SandboxSpec, applied or the create fails."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker.types

from orchestrator.core.errors import LimitNotAppliedError
from orchestrator.core.sandbox import Limits, SandboxSpec

ENVD_MOUNT = "/run/envd"
# What a sandbox's processes leave behind when they end is charged to its memory and stays there: the files of its
# tmpfs mounts (/tmp, the workspace, /dev/shm), their inodes (about 1 KB of kernel memory each, an empty file too) and
# its SysV shared memory. All of it is sized together under the memory limit, with this much of the limit kept for
# envd and the processes, so that a full workspace is ENOSPC for the writer, never an OOM kill of the sandbox, and the
# next command (the grader's) always has room to start. Before, nothing bounded a sandbox's SysV shared memory or its
# inodes, and the engine's /dev/shm (64 MB) was not counted: a policy's last command that left them full had the
# grader OOM-killed before it ran the solution, an infrastructure failure that masked the rollout.
MIN_PROCESS_RESERVE_MB = 48
INODE_BYTES = 1024  # an inode and its dentry, as charged (about 965 bytes measured on tmpfs)
INODES_PER_MB = 64  # a tmpfs's inodes: one per 16 KB of its size (at least MIN_INODES)
MIN_INODES = 256
SHM_MB = 64  # /dev/shm as the engine makes it, and as much SysV shared memory, at most 1/32 of the memory each
SHM_SEGMENTS = 64
PAGE_BYTES = 4096
# SysV message queues and semaphores, in the namespace's own: a few queues of the kernel's 16 KB, and the kernel's
# old semaphore defaults (SEMMSL SEMMNS SEMOPM SEMMNI); both fit in the reserve
IPC_SYSCTLS = {"kernel.msgmni": "16", "kernel.msgmnb": "16384", "kernel.sem": "250 32000 32 128"}
LIMIT_WARNING_WORDS = ("limit", "memory", "swap", "cpu", "pids", "discarded", "not support")


@dataclass(frozen=True)
class Leftovers:
    """The sizes, in MB, of what a sandbox's processes can leave behind: its /tmp, its workspace, its /dev/shm and
    its SysV shared memory (shm_mb each), with each tmpfs's inodes."""

    tmp_mb: int
    workspace_mb: int
    shm_mb: int

    @staticmethod
    def inodes(size_mb: int) -> int:
        """The inodes of a tmpfs of `size_mb`."""
        return max(MIN_INODES, size_mb * INODES_PER_MB)

    def charged_mb(self) -> float:
        """The most memory all of it can hold."""
        tmpfs = (self.tmp_mb, self.workspace_mb, self.shm_mb)
        return sum(tmpfs) + sum(self.inodes(mb) for mb in tmpfs) * INODE_BYTES / (1 << 20) + self.shm_mb


LOG_CAP = {"max-size": "1m", "max-file": "1"}  # a sandbox's log on the engine's disk (json-file)


def leftovers(lim: Limits) -> Leftovers:
    """/dev/shm and SysV shared memory at SHM_MB each (at most 1/32 of the memory), and /tmp and the workspace as
    asked, or scaled down together into what is left under the memory limit with a reserve for envd and the processes.

    Fails closed (LimitNotAppliedError) when the memory limit leaves no room for them.
    """
    reserve = max(MIN_PROCESS_RESERVE_MB, lim.memory_mb // 4)
    budget = lim.memory_mb - reserve
    shm = max(1, min(SHM_MB, lim.memory_mb // 32))
    asked = Leftovers(lim.tmp_mb, lim.workspace_mb, shm)
    if asked.charged_mb() <= budget:
        return asked
    # both by one factor, a little under what fits (the inodes' floor is not linear)
    factor = budget / asked.charged_mb()
    while factor > 0:
        scaled = Leftovers(int(lim.tmp_mb * factor), int(lim.workspace_mb * factor), shm)
        if min(scaled.tmp_mb, scaled.workspace_mb) < 1:
            break
        if scaled.charged_mb() <= budget:
            return scaled
        factor -= 0.005
    raise LimitNotAppliedError(
        f"memory_mb={lim.memory_mb} leaves no room for the /tmp, workspace and shared-memory tmpfs ({reserve} MB are "
        f"kept for envd and the sandbox's processes); raise memory_mb"
    )


def host_config(
    api: Any, spec: SandboxSpec, socket_dir: Path | None, *, swap_limit: bool, nofile: int, runtime: str = ""
) -> Any:
    """The engine's HostConfig for a sandbox of `spec`, with envd's socket directory bound at ENVD_MOUNT and the
    OCI `runtime` (already checked to be one the engine has; empty: the engine's default)."""
    lim, hard = spec.limits, spec.hardening
    uid, gid = hard.user.split(":")
    left = leftovers(lim)

    def tmpfs(size_mb: int, mode: str, run: str = "exec") -> str:
        return f"rw,{run},nosuid,nodev,size={size_mb}m,nr_inodes={left.inodes(size_mb)},{mode}"

    kwargs: dict[str, Any] = {
        "network_mode": "none",
        "read_only": hard.read_only_root,
        "cap_drop": ["ALL"] if hard.cap_drop_all else None,
        "security_opt": ["no-new-privileges"] if hard.no_new_privileges else None,
        # envd is PID 1 itself: a namespace's init takes no signal from inside it, so no `kill 1` stops envd and
        # turns a rollout into an infrastructure retry; docker's init would pass signals on to it
        "init": hard.init and spec.transport != "envd",
        "pids_limit": lim.pids,
        # the engine keeps the container's stdout and stderr in a file on the host's disk: a tenant's image whose
        # envd is a wrapper (PID 1 is the image's) left `yes` writing there for the sandbox's whole life, without
        # bound. Kept, capped, for the startup's diagnostics (startup.py)
        "log_config": docker.types.LogConfig(type="json-file", config=dict(LOG_CAP)),
        "mem_limit": f"{lim.memory_mb}m",
        "nano_cpus": int(lim.cpus * 1e9),
        # set here, not inherited from the engine's default (often 1M): one process cannot hold the host's file table
        # and no core dumps: a crash would start the host's core handler (root, outside the sandbox's cgroup), which
        # writes the sandbox's memory to the host's disk; at 0 systemd-coredump and apport keep nothing
        "ulimits": [
            docker.types.Ulimit(name="nofile", soft=nofile, hard=nofile),
            docker.types.Ulimit(name="core", soft=0, hard=0),
        ],
        "tmpfs": {
            "/tmp": tmpfs(left.tmp_mb, "mode=1777"),
            spec.workspace: tmpfs(left.workspace_mb, f"uid={uid},gid={gid},mode=0755"),
            # in place of the engine's, which has no inode cap and is not counted
            "/dev/shm": tmpfs(left.shm_mb, "mode=1777", run="noexec"),
        },
        # the IPC namespace is the sandbox's own: its SysV shared memory in bytes and in pages, and its segments
        "sysctls": {
            "kernel.shmmax": str(left.shm_mb << 20),
            "kernel.shmall": str((left.shm_mb << 20) // PAGE_BYTES),
            "kernel.shmmni": str(SHM_SEGMENTS),
            **IPC_SYSCTLS,
        },
    }
    if swap_limit:
        kwargs["memswap_limit"] = f"{lim.memory_mb}m"  # no swap beyond the memory limit
    if runtime:
        kwargs["runtime"] = runtime
    if socket_dir is not None:
        kwargs["binds"] = {str(socket_dir): {"bind": ENVD_MOUNT, "mode": "rw"}}
    return api.create_host_config(**kwargs)


def limit_warnings(created: Mapping[str, Any]) -> list[str]:
    """The engine's create warnings that say a limit was not applied."""
    return [w for w in created.get("Warnings") or [] if any(k in w.lower() for k in LIMIT_WARNING_WORDS)]
