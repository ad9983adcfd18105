"""A tenant cannot queue its neighbours' execs behind its own: exec admission's places go round the tenants waiting
(orchestrator/backends/admission.py). Real Docker, one place: tenant "greedy" queues eight long commands, each
holding the place its full hold; tenant "modest"'s command, asked for after all eight, starts third (after the one
holding the place and the greedy tenant's next turn, which came before it), not ninth. Nor can a tenant start its
processes all at once through streamed execs (a raw sandbox's ExecStream) while its neighbours' execs take turns:
streams take turns too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from orchestrator.backends.pool import TENANT_LABEL
from orchestrator.core.sandbox import ExecOutput, Sandbox, SandboxSpec
from tests.conftest import owned_backend

# each command prints when it started (the host's clock: containers share it), then the greedy ones run on
STARTED = "date +%s.%N"


@contextlib.asynccontextmanager
async def _greedy_and_modest(image: str) -> AsyncIterator[tuple[Sandbox, Sandbox]]:
    """A sandbox of each tenant on a backend of one place, where execs take long: each holds it the whole 0.3 s."""
    async with owned_backend(exec_admission=1, exec_admission_hold_s=0.3) as backend:
        greedy, modest = await asyncio.gather(
            backend.create(SandboxSpec(image=image, labels={TENANT_LABEL: "greedy"})),
            backend.create(SandboxSpec(image=image, labels={TENANT_LABEL: "modest"})),
        )
        try:
            assert backend.admission is not None
            backend.admission.typical_s = 10.0
            yield greedy, modest
        finally:
            await asyncio.gather(greedy.close(), modest.close())


async def test_a_neighbour_waits_one_turn_not_behind_a_greedy_tenant(base_image: str) -> None:
    async with _greedy_and_modest(base_image) as (greedy, modest):
        longs = [asyncio.ensure_future(greedy.exec(["sh", "-c", f"{STARTED}; sleep 2"])) for _ in range(8)]
        await asyncio.sleep(0.2)  # each asks for its place at its first step: one admitted, seven waiting
        mine = await modest.exec(["sh", "-c", STARTED])
        results = await asyncio.gather(*longs)
        assert mine.exit_code == 0 and all(r.exit_code == 0 for r in results)
        starts = sorted(float(r.stdout) for r in results)
        # first come first served would have started it after all eight
        assert float(mine.stdout) < starts[2], (float(mine.stdout), starts)


async def _streamed_start(sandbox: Sandbox) -> float:
    """Run a long command through exec_stream; when it started, by its first line of output."""
    started = None
    async for ev in sandbox.exec_stream(["sh", "-c", f"{STARTED}; sleep 2"]):
        if isinstance(ev, ExecOutput) and started is None:
            started = float(ev.data)
    assert started is not None
    return started


async def test_streamed_execs_take_turns_too(base_image: str) -> None:
    """Eight streamed long commands of one tenant, then a neighbour's exec: the streams start one a hold apart, the
    neighbour's third (unadmitted, all eight would start at once and the neighbour's after them)."""
    async with _greedy_and_modest(base_image) as (greedy, modest):
        streams = [asyncio.ensure_future(_streamed_start(greedy)) for _ in range(8)]
        await asyncio.sleep(0.2)
        mine = await modest.exec(["sh", "-c", STARTED])
        starts = sorted(await asyncio.gather(*streams))
        assert mine.exit_code == 0
        assert float(mine.stdout) < starts[2], (float(mine.stdout), starts)
        # from the first to the eighth: seven more turns of the greedy tenant and one of its neighbour's, 0.3 s each
        assert starts[-1] - starts[0] > 7 * 0.3, starts
