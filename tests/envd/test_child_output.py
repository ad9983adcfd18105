"""The Python envd's output loop (envd/child.py Child.output) against a command that never stops writing, driven
without a process: the pipes' side is a task that adds a chunk every 0.1 ms, the consumer (envd's gRPC stream) takes
0.2 ms a message. tests/security/test_envd_hostile_state.py runs both envds on real sandboxes."""

from __future__ import annotations

import asyncio
from collections import deque

from envd.child import Child, Output


def _child() -> Child:
    child = Child.__new__(Child)  # no process: only what output() reads
    child._loop = asyncio.get_running_loop()
    child.pending = deque()
    child.exited = False
    child._readers = {3: 1}
    child._paused = False

    async def wait(deadline: float) -> None:
        await asyncio.sleep(0.0001)

    child.wait = wait  # type: ignore[method-assign]
    return child


async def test_output_returns_at_its_deadline_while_output_keeps_coming() -> None:
    # the deadline was checked only when nothing was pending: output that kept coming while each message went out
    # kept the loop going past the command's timeout, for as long as the output budget lasted
    child = _child()
    loop = asyncio.get_running_loop()

    async def writes() -> None:
        while True:
            child.pending.append(Output(1, b"x"))
            await asyncio.sleep(0.0001)

    writer = asyncio.create_task(writes())
    start = loop.time()
    messages = 0
    try:
        async for _ in child.output(start + 0.3, until_exit=True):
            messages += 1
            await asyncio.sleep(0.0002)
            if loop.time() - start > 3:
                break
    finally:
        writer.cancel()
    assert loop.time() - start < 1.0, "it ran past its deadline"
    assert 0 < messages < 300, "paced: a burst, then one turn each 2 ms"
