"""Sessions and raw sandboxes hold their share of the host until they end (a TTL of up to a day). With no share per
tenant, one tenant's idle sandboxes took the whole host: every other tenant's jobs queued and its sessions were
refused for as long as it kept them. Each tenant now holds at most capacity.tenant_share of each of the host's
figures; a server without tokens has one user (tenant "local"), who is not held to it."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from orchestrator.core.errors import QuotaExceededError
from orchestrator.service.scheduler import Capacity, Need, Scheduler
from tests.orchestrator.servers import FAKE, serve


async def _never(item: object) -> None:
    raise AssertionError("nothing is queued here")


async def test_a_tenant_holds_at_most_its_share_and_the_rest_is_left_to_others() -> None:
    s = Scheduler(8, _never, Capacity(max_sandboxes=10, cpus=8, memory_mb=8000, tenant_share=0.5))
    s.tenant_shares = True  # as a server with tokens sets it
    big = Need(cpus=2, memory_mb=1000)
    a = [s.reserve(big, "a sandbox", "team-a") for _ in range(2)]  # 4 CPUs: its half
    with pytest.raises(QuotaExceededError, match=r"capacity\.tenant_share = 0\.5"):
        s.reserve(big, "a sandbox", "team-a")
    b = [s.reserve(big, "a session", "team-b") for _ in range(2)]  # the other half is still there for team-b
    a.pop().release()
    a.append(s.reserve(big, "a sandbox", "team-a"))  # what it gave back it may take again
    for r in a + b:
        r.release()
    assert s.reserved == 0
    # memory and the sandbox count are shares too
    first = s.reserve(Need(cpus=0.5, memory_mb=4000), "a sandbox", "team-a")
    with pytest.raises(QuotaExceededError):
        s.reserve(Need(cpus=0.5, memory_mb=1), "a sandbox", "team-a")
    first.release()
    few = [s.reserve(Need(cpus=0.1, memory_mb=10), "a sandbox", "team-a") for _ in range(5)]
    with pytest.raises(QuotaExceededError):
        s.reserve(Need(cpus=0.1, memory_mb=10), "a sandbox", "team-a")
    for r in few:
        r.release()
    # with tokens, a tenant named "local" is a tenant like any other
    mine = [s.reserve(big, "a sandbox", "local") for _ in range(2)]
    with pytest.raises(QuotaExceededError):
        s.reserve(big, "a sandbox", "local")
    # the one user of a server without tokens takes the whole host
    s.tenant_shares = False
    mine += [s.reserve(big, "a sandbox", "local") for _ in range(2)]
    assert s.reserved == 4
    for r in mine:
        r.release()


async def test_a_share_too_small_for_one_sandbox_still_lets_a_tenant_have_one() -> None:
    # max_sandboxes 1: half of it is no sandbox at all, and every tenant was refused for good, holding nothing
    s = Scheduler(8, _never, Capacity(max_sandboxes=1, cpus=8, memory_mb=8000, tenant_share=0.5))
    s.tenant_shares = True
    only = s.reserve(Need(cpus=6, memory_mb=100), "a session", "team-a")
    only.release()


async def test_a_server_holds_tenants_to_their_share_when_it_has_tokens(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"tokens:\n  {secrets.token_urlsafe(24)}: team-a\n")
    async with serve(tmp_path / "with", backend=FAKE, security={"token_file": tokens}) as orch:
        assert orch.jobs.scheduler.tenant_shares
    async with serve(tmp_path / "without", backend=FAKE) as orch:
        assert not orch.jobs.scheduler.tenant_shares
