"""envd's Reset empties /tmp and /dev/shm and kills every process it can see: right inside a sandbox, ruinous on a
host. An envd running as root is no sandbox's (the sandbox user is never root), so its Reset is refused before it
touches anything. (A Reset once ran on this project's dev host from an envd started there by hand, and emptied the
host's /tmp.)"""

from __future__ import annotations

import os

import pytest

import envd.reset as reset


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the reset went on past its guard")


@pytest.mark.skipif(os.geteuid() != 0, reason="the guard is about an envd running as root")
def test_a_reset_as_root_is_refused_before_it_kills_or_wipes_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    # if the guard were gone, these stand-ins (not the real kill and wipe) are what the reset would reach
    monkeypatch.setattr(reset, "kill_all_others", _must_not_run)
    monkeypatch.setattr(reset, "_empty_dir", _must_not_run)
    monkeypatch.setattr(reset, "clear_ipc", _must_not_run)
    got = reset.reset_sandbox("/workspace", "/run/envd", "envd.sock", "")
    assert not got.ok and "root" in got.detail and got.killed == 0
