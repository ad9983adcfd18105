"""The container's HostConfig: every hardening flag and limit of a SandboxSpec, applied or the create fails."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import docker.types

from orchestrator.core.errors import LimitNotAppliedError
from orchestrator.core.sandbox import Limits, SandboxSpec

ENVD_MOUNT = "/run/envd"
# tmpfs pages are charged to the sandbox's memory: this much of the limit stays for envd and the processes, so a
# full workspace is ENOSPC for the writer, never an OOM kill of the sandbox
MIN_PROCESS_RESERVE_MB = 48
LIMIT_WARNING_WORDS = ("limit", "memory", "swap", "cpu", "pids", "discarded", "not support")


def tmpfs_sizes(lim: Limits) -> tuple[int, int]:
    """(/tmp, workspace) sizes in MB: as asked, or scaled down together to fit under the memory limit with a reserve.

    Fails closed (LimitNotAppliedError) when the memory limit leaves no room for both.
    """
    reserve = max(MIN_PROCESS_RESERVE_MB, lim.memory_mb // 4)
    budget = lim.memory_mb - reserve
    asked = lim.tmp_mb + lim.workspace_mb
    if asked <= budget:
        return lim.tmp_mb, lim.workspace_mb
    tmp, ws = lim.tmp_mb * budget // asked, lim.workspace_mb * budget // asked
    if tmp < 1 or ws < 1:
        raise LimitNotAppliedError(
            f"memory_mb={lim.memory_mb} leaves no room for the /tmp and workspace tmpfs ({reserve} MB are kept for "
            f"envd and the sandbox's processes); raise memory_mb"
        )
    return tmp, ws


def host_config(
    api: Any, spec: SandboxSpec, socket_dir: Path | None, *, swap_limit: bool, nofile: int, runtime: str = ""
) -> Any:
    """The engine's HostConfig for a sandbox of `spec`, with envd's socket directory bound at ENVD_MOUNT and the
    OCI `runtime` (already checked to be one the engine has; empty: the engine's default)."""
    lim, hard = spec.limits, spec.hardening
    uid, gid = hard.user.split(":")
    tmp_mb, workspace_mb = tmpfs_sizes(lim)
    kwargs: dict[str, Any] = {
        "network_mode": "none",
        "read_only": hard.read_only_root,
        "cap_drop": ["ALL"] if hard.cap_drop_all else None,
        "security_opt": ["no-new-privileges"] if hard.no_new_privileges else None,
        # envd is PID 1 itself: a namespace's init takes no signal from inside it, so no `kill 1` stops envd and
        # turns a rollout into an infrastructure retry; docker's init would pass signals on to it
        "init": hard.init and spec.transport != "envd",
        "pids_limit": lim.pids,
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
            "/tmp": f"rw,exec,nosuid,nodev,size={tmp_mb}m,mode=1777",
            spec.workspace: f"rw,exec,nosuid,nodev,size={workspace_mb}m,uid={uid},gid={gid},mode=0755",
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
