"""envd started the way sandbox images start it (envd/launch.py), and its command line."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from envd.__main__ import parse_options
from orchestrator.backends.envd_transport import EnvdTransport
from tests.conftest import REPO, stop_process


@pytest.fixture
def launched_envd(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """envd run through launch.py: (process, socket path)."""
    sock = str(tmp_path / "envd.sock")
    (tmp_path / "token").write_text("test-token")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "envd" / "launch.py"), "--socket", sock, "--workspace", str(tmp_path)],
        cwd=tmp_path,
    )
    try:
        yield proc, sock
    finally:
        stop_process(proc)


async def test_launched_envd_serves_without_loading_openssl(
    launched_envd: tuple[subprocess.Popen[bytes], str],
) -> None:
    # OpenSSL is about 2 MB of private memory in every sandbox; envd speaks gRPC on a unix socket and needs none of it
    proc, sock = launched_envd
    t = EnvdTransport(sock, "test-token")
    try:
        for _ in range(500):
            if os.path.exists(sock) and await t.health(timeout=1):
                break
            assert proc.poll() is None, "envd exited"
            await asyncio.sleep(0.02)
        r = await t.exec(["true"])
        assert r.exit_code == 0
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libssl" not in maps and "libcrypto" not in maps
    finally:
        await t.close()


def test_options_defaults_and_both_spellings() -> None:
    assert parse_options([]) == {
        "socket": "/run/envd/envd.sock",
        "token-file": "",
        "workspace": "/workspace",
        "log-level": "WARNING",
    }
    assert parse_options(["--socket", "/s.sock", "--token-file=/t", "--workspace=/w", "--log-level=INFO"]) == {
        "socket": "/s.sock",
        "token-file": "/t",
        "workspace": "/w",
        "log-level": "INFO",
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "1"], "unknown argument '--port'"),
        (["/s.sock"], "unknown argument '/s.sock'"),
        (["--socket"], "--socket needs a value"),
        (["--workspace="], "--workspace= needs a value"),
    ],
)
def test_bad_options_exit_with_usage(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=f"(?s){re.escape(message)}.*usage: envd") as e:
        parse_options(argv)
    assert isinstance(e.value.code, str)
