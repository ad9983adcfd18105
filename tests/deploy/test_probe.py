"""The health probe of the image against a real server: plaintext, TLS and mTLS, configured as in a container (the
server's ENVFLEET_* variables) or by flags."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.orchestrator.servers import serve

pytestmark = pytest.mark.docker


async def _probe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The probe as docker runs it, in a subprocess (waited for in a thread: the server shares this event loop)."""
    p = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "orchestrator.cli.healthcheck", *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        # no serving file unless the test names a data directory: the repository's .envfleet may hold a demo's
        env={"PATH": "/usr/bin:/bin", "ENVFLEET_DATA_DIR": "/nonexistent", **(env or {})},
        check=False,
    )
    return p.returncode, p.stdout.strip()


async def test_probe_plaintext_from_the_server_variables(tmp_path: Path, base_image: str) -> None:
    async with serve(tmp_path / "data") as orch:
        assert await _probe(env={"ENVFLEET_PORT": str(orch.port), "ENVFLEET_HOST": "0.0.0.0"}) == (0, "SERVING")
    code, out = await _probe(f"127.0.0.1:{orch.port}", "--timeout", "1")
    assert code == 1 and out.startswith("UNREACHABLE: UNAVAILABLE"), out


async def test_probe_tls_and_mtls(tmp_path: Path, pki: dict[str, Path], base_image: str) -> None:
    tls = {"cert_file": pki["server_cert"], "key_file": pki["server_key"]}
    async with serve(tmp_path / "tls", security={"tls": tls}) as orch:
        address = f"127.0.0.1:{orch.port}"
        assert await _probe(address, "--tls-ca", str(pki["ca"])) == (0, "SERVING")
        # in the container: the server's variables, and the CA the probe trusts
        env = {"ENVFLEET_PORT": str(orch.port), "ENVFLEET_TLS_CERT": str(pki["server_cert"])}
        assert await _probe(env={**env, "ENVFLEET_HEALTH_TLS_CA": str(pki["ca"])}) == (0, "SERVING")
        code, out = await _probe(address, "--timeout", "1")  # plaintext against TLS
        assert code == 1 and out.startswith("UNREACHABLE"), out

    async with serve(tmp_path / "mtls", security={"tls": {**tls, "client_ca_file": pki["ca"]}}) as orch:
        address = f"127.0.0.1:{orch.port}"
        code, out = await _probe(address, "--tls-ca", str(pki["ca"]), "--timeout", "1")
        assert code == 1 and out.startswith("UNREACHABLE"), out  # no client certificate
        client = ("--tls-cert", str(pki["client_cert"]), "--tls-key", str(pki["client_key"]))
        assert await _probe(address, "--tls-ca", str(pki["ca"]), *client) == (0, "SERVING")


async def test_probe_finds_a_server_configured_by_its_file_or_flags(
    tmp_path: Path, pki: dict[str, Path], base_image: str
) -> None:
    # the probe read ENVFLEET_PORT and ENVFLEET_TLS_CERT alone: a server whose port or TLS came from a flag or the
    # config file (deploy/run.sh IMAGE --port 6000, `tls-cert:` in the file) was reported unhealthy. The server says
    # where it listens in its data directory; the variables, wrong here, give way to it
    data = tmp_path / "data"
    tls = {"cert_file": pki["server_cert"], "key_file": pki["server_key"]}
    wrong = {"ENVFLEET_PORT": "1", "ENVFLEET_DATA_DIR": str(data), "ENVFLEET_HEALTH_TLS_CA": str(pki["ca"])}
    async with serve(data, security={"tls": tls}) as orch:
        assert json.loads((data / "serving.json").read_text())["port"] == orch.port
        assert await _probe(env=wrong) == (0, "SERVING")
    assert not (data / "serving.json").exists()  # a stopped server is not where to look


async def test_probe_passes_over_the_file_of_a_server_that_is_gone(tmp_path: Path, base_image: str) -> None:
    # a server killed (SIGKILL, the OOM killer) leaves its file: until the next one writes its own, the probe goes by
    # the variables, not by a port no one listens on. In a container the next server has the same pid (1): a pid that
    # runs, started at another tick, is another process
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "stale"
    stale.mkdir()
    async with serve(tmp_path / "data") as orch:
        for pid, started in ((int(gone.stdout), "1"), (os.getpid(), "1")):
            info = {"host": "127.0.0.1", "port": 1, "pid": pid, "started": started}
            (stale / "serving.json").write_text(json.dumps(info))
            env = {"ENVFLEET_PORT": str(orch.port), "ENVFLEET_DATA_DIR": str(stale)}
            assert await _probe(env=env) == (0, "SERVING"), info
