"""The container's HostConfig: every hardening flag and limit of a SandboxSpec, applied or the create fails."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import docker.types

from orchestrator.core.sandbox import SandboxSpec

ENVD_MOUNT = "/run/envd"
LIMIT_WARNING_WORDS = ("limit", "memory", "swap", "cpu", "pids", "discarded", "not support")


def host_config(api: Any, spec: SandboxSpec, socket_dir: Path | None, *, swap_limit: bool, nofile: int) -> Any:
    """The engine's HostConfig for a sandbox of `spec`, with envd's socket directory bound at ENVD_MOUNT."""
    lim, hard = spec.limits, spec.hardening
    uid, gid = hard.user.split(":")
    kwargs: dict[str, Any] = {
        "network_mode": "none",
        "read_only": hard.read_only_root,
        "cap_drop": ["ALL"] if hard.cap_drop_all else None,
        "security_opt": ["no-new-privileges"] if hard.no_new_privileges else None,
        "init": hard.init,
        "pids_limit": lim.pids,
        "mem_limit": f"{lim.memory_mb}m",
        "nano_cpus": int(lim.cpus * 1e9),
        # set here, not inherited from the engine's default (often 1M): one process cannot hold the host's file table
        "ulimits": [docker.types.Ulimit(name="nofile", soft=nofile, hard=nofile)],
        "tmpfs": {
            "/tmp": f"rw,exec,nosuid,nodev,size={lim.tmp_mb}m,mode=1777",
            spec.workspace: f"rw,exec,nosuid,nodev,size={lim.workspace_mb}m,uid={uid},gid={gid},mode=0755",
        },
    }
    if swap_limit:
        kwargs["memswap_limit"] = f"{lim.memory_mb}m"  # no swap beyond the memory limit
    if socket_dir is not None:
        kwargs["binds"] = {str(socket_dir): {"bind": ENVD_MOUNT, "mode": "rw"}}
    return api.create_host_config(**kwargs)


def limit_warnings(created: Mapping[str, Any]) -> list[str]:
    """The engine's create warnings that say a limit was not applied."""
    return [w for w in created.get("Warnings") or [] if any(k in w.lower() for k in LIMIT_WARNING_WORDS)]
