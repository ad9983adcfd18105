"""The health probe of the image against a real server: plaintext, TLS and mTLS, configured as in a container (the
server's ENVFLEET_* variables) or by flags."""

from __future__ import annotations

import asyncio
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
        env={"PATH": "/usr/bin:/bin", **(env or {})},
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
