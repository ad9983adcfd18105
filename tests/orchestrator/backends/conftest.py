"""Fixtures of the backend tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.backends.docker.socket_dirs import SocketDirs, kept_key_path


@pytest.fixture
def socket_root() -> Iterator[Path]:
    """A socket root of this test's own (short: envd's socket path must fit a unix address)."""
    top = Path(tempfile.mkdtemp(prefix="ef-sr-", dir="/tmp"))
    root = top / "s"
    try:
        yield root
    finally:
        if root.exists():
            dirs = SocketDirs(root)
            for name in dirs.names():  # what a failed test left: unmounted, then removed
                dirs.remove(name)
        shutil.rmtree(top)
        kept_key_path(root).unlink(missing_ok=True)  # the root's key, kept for its next boot
