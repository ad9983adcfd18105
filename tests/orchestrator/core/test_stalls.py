"""A stalled event loop says so in the log, with where its thread is; a loop that turns says nothing."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from orchestrator.core.stalls import StallWatch


def _blocking_call_under_test() -> None:
    time.sleep(2.0)


async def test_a_stall_is_logged_once_with_the_blocking_call(caplog: pytest.LogCaptureFixture) -> None:
    watch = StallWatch("test loop", threshold_s=0.8)
    watch.start()
    try:
        with caplog.at_level(logging.WARNING, logger="orchestrator.core.stalls"):
            await asyncio.sleep(1.0)  # turning: nothing to say
            assert watch.stalls == 0 and not caplog.records
            _blocking_call_under_test()
            await asyncio.sleep(1.0)
    finally:
        await watch.stop()
    assert watch.stalls == 1 and watch.longest_s >= 0.8
    stalled = [r.getMessage() for r in caplog.records if "has not turned" in r.getMessage()]
    assert len(stalled) == 1 and "_blocking_call_under_test" in stalled[0], stalled
    assert any("turns again" in r.getMessage() for r in caplog.records)
