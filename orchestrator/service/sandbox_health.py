"""Whether a raw sandbox's (or a session's) container died: a health call to its envd, and the engine's word only
when envd refuses (cheap while it lives: no engine call per sandbox per check)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from orchestrator.core.echo import echo
from orchestrator.core.errors import SandboxError
from orchestrator.core.sandbox import Sandbox, SandboxState

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

PROBE_TIMEOUT_S = 2.0  # an envd with no answer by then is starved of CPU, not gone (EnvdTransport.probe)
CHECK_TIMEOUT_S = 10.0  # a health check and the engine's word on the container: past this, no verdict this round
PROBE_CONCURRENCY = 64  # health checks at once


async def died(sandbox: Sandbox, name: str) -> str | None:
    """Why the sandbox's container is dead (its end reason), or None: alive, or no verdict (envd slow, the engine
    silent or down, as during a dockerd restart)."""
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            if await sandbox.probe(PROBE_TIMEOUT_S) != "gone":
                return None
            st = await sandbox.state()
    except (TimeoutError, SandboxError) as e:
        log.info("sandbox %s: no verdict on its health this round: %s", name, e)
        return None
    return None if st.running else death(st)


async def each_checked(
    items: Sequence[T], check: Callable[[T], Awaitable[R]], name: Callable[[T], str]
) -> list[R | None]:
    """`check` of each item, PROBE_CONCURRENCY at a time; one whose check raised is logged, and None (one failing
    check leaves the others' verdicts standing)."""
    turns = asyncio.Semaphore(PROBE_CONCURRENCY)

    async def one(item: T) -> R:
        async with turns:
            return await check(item)

    outcomes = await asyncio.gather(*(one(x) for x in items), return_exceptions=True)
    verdicts: list[R | None] = []
    for x, outcome in zip(items, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            log.error("health check of %s failed", name(x), exc_info=outcome)
            verdicts.append(None)
        else:
            verdicts.append(outcome)
    return verdicts


def death(st: SandboxState) -> str:
    """The end reason of a sandbox whose container is no longer running, from the engine's view of it."""
    if st.exit_code is None:
        return "its container no longer exists"
    how = "was killed by the OOM killer" if st.oom_killed else "stopped"
    return f"its container {how}, exit code {st.exit_code}" + (f": {echo(st.error)}" if st.error else "")
