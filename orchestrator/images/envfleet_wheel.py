"""envfleet itself as a wheel, built offline from this source checkout, for the orchestrator's image.

Installing the distribution (not copying the source tree) is what gives the image its metadata: the
`envfleet.environments` and `envfleet.cli` entry points and `importlib.metadata.version("envfleet")`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from orchestrator.core.errors import ImageBuildError
from orchestrator.images.cache import log_tail
from orchestrator.images.wheels import unpack_wheel

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
# what the wheel is built from: the packaging metadata and the packages pyproject.toml includes
SOURCE_FILES = ("pyproject.toml", "README.md")
SOURCE_PACKAGES = ("protos", "envd", "orchestrator", "environments")
WHEEL_TIMEOUT_S = 300.0
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")


def build_envfleet_wheel(out_dir: Path, log_dir: Path, repo: Path = REPO) -> Path:
    """Build the envfleet wheel into `out_dir` with pip and the installed setuptools, no network; return its path.

    The build runs on a copy of the sources, so the checkout gets no `build/` or `*.egg-info`."""
    if not (repo / "pyproject.toml").is_file():
        raise ImageBuildError(f"{repo} has no pyproject.toml: build the orchestrator image from a source checkout")
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "envfleet-wheel.log"
    with tempfile.TemporaryDirectory(prefix="envfleet-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in SOURCE_FILES:
            shutil.copy2(repo / name, src / name)
        for package in SOURCE_PACKAGES:
            shutil.copytree(repo / package, src / package, ignore=_IGNORE)
        argv = [
            sys.executable, "-m", "pip", "wheel",
            "--no-deps", "--no-build-isolation", "--no-index",
            "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
            "--wheel-dir", str(out_dir), str(src),
        ]  # fmt: skip
        with log_path.open("wb") as logf:
            logf.write(("$ " + " ".join(argv) + "\n").encode())
            logf.flush()
            try:
                proc = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    timeout=WHEEL_TIMEOUT_S,
                    cwd=tmp,
                    env={**os.environ, "PIP_NO_INPUT": "1"},
                )
            except subprocess.TimeoutExpired as e:
                raise ImageBuildError(
                    f"building the envfleet wheel timed out; log {log_path}", log_path=log_path, step="wheel"
                ) from e
    if proc.returncode != 0:
        raise ImageBuildError(
            f"building the envfleet wheel failed with exit status {proc.returncode}; log {log_path}:\n"
            f"{log_tail(log_path)}",
            log_path=log_path,
            step="wheel",
        )
    wheels = sorted(out_dir.glob("envfleet-*.whl"))
    if len(wheels) != 1:
        raise ImageBuildError(f"expected one envfleet wheel in {out_dir}, found {[w.name for w in wheels]}")
    return wheels[0]


def install_wheels(wheels: list[Path], site: Path) -> str:
    """Unpack `wheels` (with their `.dist-info`) into `site`; return a hash of what they installed.

    The hash is taken over each wheel's RECORD (every file's path and sha256), not over the zip, whose timestamps
    change with every build."""
    digest = hashlib.sha256()
    for wheel in sorted(wheels, key=lambda w: w.name):
        before = {p.name for p in site.glob("*.dist-info")} if site.is_dir() else set()
        unpack_wheel(wheel, site)
        records = [p / "RECORD" for p in site.glob("*.dist-info") if p.name not in before]
        if len(records) != 1 or not records[0].is_file():
            raise ImageBuildError(f"wheel {wheel.name} installed no single .dist-info with a RECORD", step="wheel")
        digest.update(wheel.name.split("-")[0].encode() + b"\0" + records[0].read_bytes())
    return digest.hexdigest()


def wheel_dependencies(site: Path, distribution: str = "envfleet") -> list[str]:
    """The names of what an unpacked wheel's distribution requires (its METADATA, extras left out).

    Read from the wheel just built, not the host's installed metadata, which an editable install leaves stale."""
    from packaging.requirements import Requirement

    found = sorted(site.glob(f"{distribution}-*.dist-info/METADATA"))
    if len(found) != 1:
        raise ImageBuildError(f"{site} holds no single {distribution} METADATA", step="wheel")
    names = []
    for line in found[0].read_text(encoding="utf-8").splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.removeprefix("Requires-Dist:").strip())
            if req.marker is None or "extra" not in str(req.marker):
                names.append(req.name)
    return names
