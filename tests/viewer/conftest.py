"""The trajectory viewer's fixtures: a real headless Chromium (Debian's `chromium`, installed by `make chromium`),
driven with its own --dump-dom and --screenshot, and a file of synthetic rollouts."""

from __future__ import annotations

import asyncio
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.cli.view import toy_decoder
from orchestrator.core.models import Rollout
from orchestrator.viewer import FileSource, ViewerServer, start_viewer

WINDOW = (1280, 800)
BROWSER_TIMEOUT_S = 90


@dataclass(frozen=True)
class Browser:
    """Headless Chromium, one process per page load; its profile lives in the test's tmp_path."""

    path: str
    profile: Path

    async def _run(self, url: str, *flags: str) -> str:
        # a subprocess on the event loop: a live viewer asks the orchestrator's loop (this one) who may see what
        proc = await asyncio.create_subprocess_exec(
            self.path,
            "--headless",
            "--no-sandbox",  # tests run as root in a container; the pages are ours and script-free (CSP)
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={self.profile}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            *flags,
            url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(BROWSER_TIMEOUT_S):
                out, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {err.decode()[-2000:]}"
        return out.decode()

    async def dom(self, url: str) -> str:
        """The page's DOM after load, serialized."""
        dom = await self._run(url, "--dump-dom")
        assert "<html" in dom, f"no page at {url}: {dom[:500]!r}"
        return dom

    async def screenshot(self, url: str, out: Path) -> tuple[int, int]:
        """Save a PNG of the page at the window size; returns its width and height (from the PNG header)."""
        await self._run(url, f"--screenshot={out}")
        data = out.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
        width, height = struct.unpack(">II", data[16:24])
        return width, height


@pytest.fixture
def browser(tmp_path: Path) -> Browser:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Chromium is not installed: `make chromium` (apt-get install -y chromium)")
    return Browser(path, tmp_path / "chromium-profile")


def write_jsonl(path: Path, rollouts: list[Rollout]) -> Path:
    """Rollouts as `envfleet rollout` writes them: one JSON object per line."""
    path.write_text("".join(r.model_dump_json() + "\n" for r in rollouts), encoding="utf-8")
    return path


def serve_file(path: Path) -> ViewerServer:
    """A started viewer over a JSONL file, as `envfleet view` serves it (close it when done)."""
    return start_viewer(FileSource(path), decoder_for=toy_decoder)
