"""Execs a few at a time (orchestrator/backends/admission.py): the cap holds, turns go round the tenants, a long
command holds its place only briefly, a cancelled caller leaves nothing running or waiting; on Docker, a burst of
execs and a long one beside it (a tenant's turns on Docker: tests/security/test_exec_turns.py)."""

from __future__ import annotations

import asyncio
import functools
import os
import time

import pytest

from orchestrator.backends.admission import HOLD_MIN_S, ExecAdmission
from orchestrator.backends.config import EXECS_PER_CORE, DockerBackendConfig
from orchestrator.core.sandbox import SandboxSpec
from tests.conftest import owned_backend


async def test_at_most_slots_start_at_once_first_come_first_served() -> None:
    admission = ExecAdmission(2, max_hold_s=5.0)
    running, most, order = 0, 0, []

    async def call(i: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        order.append(i)
        await asyncio.sleep(0.002)  # well within the hold (at least HOLD_MIN_S)
        running -= 1
        return i

    assert await asyncio.gather(*(admission.run(functools.partial(call, i)) for i in range(10))) == list(range(10))
    assert most == 2
    assert order == list(range(10))


async def test_turns_go_round_the_tenants_waiting() -> None:
    """One place, held: tenant a queues five execs, then b two and c one. As the place frees, it goes a, b, c, a, b,
    a, a, a (first come first served would give b and c theirs after all of a's)."""
    admission = ExecAdmission(1, max_hold_s=5.0)
    gate = asyncio.Event()
    order: list[str] = []

    async def call(name: str) -> None:
        order.append(name)

    blocker = asyncio.ensure_future(admission.run(gate.wait, "a"))
    await asyncio.sleep(0)
    names = [f"a{i}" for i in range(5)] + ["b0", "b1", "c0"]
    calls = []
    for name in names:
        calls.append(asyncio.ensure_future(admission.run(functools.partial(call, name), name[0])))
        await asyncio.sleep(0)  # queued in this order
    gate.set()
    await asyncio.gather(blocker, *calls)
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]


async def test_a_cancelled_turn_is_skipped_and_the_place_not_lost() -> None:
    admission = ExecAdmission(1, max_hold_s=5.0)
    gate = asyncio.Event()
    blocker = asyncio.ensure_future(admission.run(gate.wait, "a"))
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(admission.run(lambda: asyncio.sleep(0, "gone"), "b"))
    kept = asyncio.ensure_future(admission.run(lambda: asyncio.sleep(0, "kept"), "c"))
    await asyncio.sleep(0)
    gone.cancel()
    gate.set()
    assert await asyncio.wait_for(kept, 1) == "kept"
    await blocker
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert admission._free == 1 and not admission._waiting


async def test_a_long_call_holds_its_place_only_hold_s() -> None:
    admission = ExecAdmission(1, max_hold_s=0.1)
    long = asyncio.ensure_future(admission.run(lambda: asyncio.sleep(3, "long")))
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    assert await admission.run(lambda: asyncio.sleep(0, "short")) == "short"
    assert time.monotonic() - t0 < 1.0  # the long one let go of its place after 0.1 s, not 3 s
    assert not long.done()
    long.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long


async def test_a_place_held_by_a_body_frees_at_its_hold_or_its_end() -> None:
    """A streamed exec's place: a body that runs on lets it go after the hold (and the average is not moved), one
    that ends sooner lets it go at once."""
    admission = ExecAdmission(1, max_hold_s=0.1)
    admission.typical_s = 10.0
    async with admission.place("a") as hold:
        assert hold == 0.1
        t0 = time.monotonic()
        assert await admission.run(lambda: asyncio.sleep(0, "waited"), "b") == "waited"
        assert 0.09 < time.monotonic() - t0 < 1.0
        typical = admission.typical_s  # moved by b's exec
        await asyncio.sleep(0.05)
    assert admission.typical_s == typical
    async with admission.place("a"):
        pass
    assert admission._free == 1 and not admission._waiting


async def test_the_hold_follows_how_long_execs_take() -> None:
    """On a host where execs take 50 ms, the hold grows past them (a fixed one would cap the starts a second); one
    long command moves it little; it never passes max_hold_s."""
    admission = ExecAdmission(4, max_hold_s=0.5)
    assert admission.hold_s == HOLD_MIN_S
    for _ in range(3):
        await asyncio.gather(*(admission.run(lambda: asyncio.sleep(0.05)) for _ in range(16)))
    assert 0.1 < admission.hold_s <= 0.5
    before = admission.hold_s
    await admission.run(lambda: asyncio.sleep(1.2))
    assert admission.hold_s < 2 * before
    await asyncio.gather(*(admission.run(lambda: asyncio.sleep(0.6)) for _ in range(40)))
    assert admission.hold_s == 0.5


async def test_errors_pass_through_and_the_place_is_given_back() -> None:
    admission = ExecAdmission(1, max_hold_s=5.0)

    async def boom() -> None:
        raise RuntimeError("the exec failed")

    with pytest.raises(RuntimeError, match="the exec failed"):
        await admission.run(lambda: boom())
    assert await asyncio.wait_for(admission.run(lambda: asyncio.sleep(0, "next")), 1) == "next"


async def test_a_cancelled_caller_leaves_nothing_behind() -> None:
    admission = ExecAdmission(1, max_hold_s=5.0)
    admission.typical_s = 10.0  # execs here take long: the first holds its place the whole test
    started: list[str] = []

    async def call(name: str) -> None:
        started.append(name)
        await asyncio.sleep(10)

    first = asyncio.ensure_future(admission.run(lambda: call("first")))
    waiting = asyncio.ensure_future(admission.run(lambda: call("waiting")))
    await asyncio.sleep(0.05)
    waiting.cancel()  # cancelled while it waits its turn: its call is never made
    first.cancel()  # cancelled while admitted: its call is cancelled
    await asyncio.gather(first, waiting, return_exceptions=True)
    assert started == ["first"]
    assert await asyncio.wait_for(admission.run(lambda: asyncio.sleep(0, "after")), 1) == "after"


def test_the_host_budget_is_shared_by_its_workers() -> None:
    config = DockerBackendConfig(exec_admission=10)
    assert config.shared_by(1) is config
    assert config.shared_by(3).exec_admission == 4  # rounded up
    assert config.shared_by(20).exec_admission == 2  # at least 2 each
    assert DockerBackendConfig().exec_slots() == EXECS_PER_CORE * (os.cpu_count() or 1)
    off = DockerBackendConfig(exec_admission_hold_s=0)
    assert off.exec_slots() == 0 and off.shared_by(4).exec_slots() == 0
    # the sandboxes starting at once too: each worker took the host's whole default for itself
    assert DockerBackendConfig(startup_concurrency=16).shared_by(4).startup_slots() == 4
    assert DockerBackendConfig().startup_slots() == max(8, 4 * (os.cpu_count() or 1))
    # a default is split on the host that runs the backend (a Ray node's cores), not fixed by the control plane's
    shared = DockerBackendConfig().shared_by(2)
    assert (shared.startup_concurrency, shared.exec_admission, shared.host_workers) == (0, 0, 2)
    assert shared.startup_slots() == -(-DockerBackendConfig().startup_slots() // 2)
    assert shared.exec_slots() == max(2, -(-DockerBackendConfig().exec_slots() // 2))
    with pytest.raises(ValueError):
        DockerBackendConfig(exec_admission=-1)


async def test_on_docker_a_burst_is_admitted_while_a_long_command_runs(base_image: str) -> None:
    """One place: a command of 4 s holds it 0.2 s; eight short execs after it all end long before it does."""
    async with owned_backend(exec_admission=1, exec_admission_hold_s=0.2) as backend:
        boxes = await asyncio.gather(*(backend.create(SandboxSpec(image=base_image)) for _ in range(3)))
        try:
            long = asyncio.ensure_future(boxes[0].exec(["sleep", "4"]))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            shorts = await asyncio.gather(*(boxes[1 + i % 2].exec(["echo", str(i)]) for i in range(8)))
            assert time.monotonic() - t0 < 3.0
            assert [r.stdout for r in shorts] == [f"{i}\n".encode() for i in range(8)]
            assert not long.done()
            assert (await long).exit_code == 0
        finally:
            await asyncio.gather(*(b.close() for b in boxes))
