"""SWE fixtures: a tiny hand-made instance (a local archive, no network) and the shipped dataset."""

from __future__ import annotations

import hashlib
import io
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from environments.swe.builder.pins import INSTANCES
from environments.swe.instance import ArchiveSource, SweInstance, TestRunner, load_instances
from environments.swe.patches import file_diff
from environments.swe.snapshot import extract_archive, snapshot_commit

GOOD = '''\
def clamp(x, lo, hi):
    """x, kept within [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def add(a, b):
    return a + b
'''
BAD = GOOD.replace("if x < lo:", "if x > lo:")
TESTS = """\
from calc import add, clamp


def test_clamp_low():
    assert clamp(-5, 0, 10) == 0


def test_clamp_high():
    assert clamp(50, 0, 10) == 10


def test_add():
    assert add(2, 3) == 5
"""
UNITTESTS = '''\
import unittest

from calc import add, clamp


class CalcTests(unittest.TestCase):
    def test_clamp(self):
        """A docstring, which unittest would print on its own line."""
        self.assertEqual(clamp(-5, 0, 10), 0)

    def test_add(self):
        self.assertEqual(add(2, 3), 5)
'''


@dataclass(frozen=True)
class Tiny:
    """A tiny project with one bug, as a pytest instance and a unittest instance."""

    pytest: SweInstance
    unittest: SweInstance
    good: str
    bad: str


def _archive(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, text in {
            "tiny-1.0/calc.py": GOOD,
            "tiny-1.0/tests/__init__.py": "",
            "tiny-1.0/tests/test_calc.py": TESTS,
            "tiny-1.0/tests/test_unit.py": UNITTESTS,
        }.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """Instances over a local archive: `clamp` has a flipped comparison."""
    archive = _archive(tmp_path_factory.mktemp("tiny") / "tiny-1.0.tar.gz")
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    with tempfile.TemporaryDirectory() as tmp:
        extract_archive(archive, Path(tmp))
        env_commit = snapshot_commit(Path(tmp))
        base = snapshot_commit(Path(tmp), {"calc.py": BAD.encode()})
    common = {
        "repo": "local/tiny",
        "base_commit": base,
        "problem_statement": "clamp(-5, 0, 10) returns -5",
        "patch": file_diff("calc.py", BAD, GOOD),
        "version": "1.0",
        "environment_setup_commit": env_commit,
        "source": ArchiveSource(path=archive, sha256=sha, setup_patch=file_diff("calc.py", GOOD, BAD)),
    }
    py = SweInstance(
        instance_id="local__tiny-1",
        FAIL_TO_PASS=["tests/test_calc.py::test_clamp_low", "tests/test_calc.py::test_clamp_high"],
        PASS_TO_PASS=["tests/test_calc.py::test_add"],
        test_runner=TestRunner(timeout_s=60),
        **common,  # type: ignore[arg-type]
    )
    ut = SweInstance(
        instance_id="local__tiny-2",
        FAIL_TO_PASS=["test_clamp (tests.test_unit.CalcTests.test_clamp)"],
        PASS_TO_PASS=["test_add (tests.test_unit.CalcTests.test_add)"],
        test_runner=TestRunner(framework="unittest", timeout_s=60),
        **common,  # type: ignore[arg-type]
    )
    return Tiny(py, ut, GOOD, BAD)


@pytest.fixture(scope="session")
def shipped() -> list[SweInstance]:
    """The dataset shipped in environments/swe/data."""
    return load_instances(INSTANCES)


@dataclass(frozen=True)
class ShippedRuns:
    """Gold and empty predictions evaluated once over the whole shipped dataset (shared by several tests)."""

    instances: list[SweInstance]
    log_dir: Path
    gold: dict[str, object]
    empty: dict[str, object]
    seconds: float


@pytest.fixture(scope="session")
def shipped_runs(shipped: list[SweInstance], base_image: str, tmp_path_factory: pytest.TempPathFactory) -> ShippedRuns:
    """Evaluate gold and empty predictions of every shipped instance (workers=2), on the suite's own backend."""
    import asyncio
    import time

    import docker

    from environments.swe.evaluate import run_evaluation
    from environments.swe.instance import empty_predictions, gold_predictions
    from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig
    from tests.conftest import TEST_OWNER

    log_dir = tmp_path_factory.mktemp("shipped-runs")

    async def go() -> tuple[dict[str, object], dict[str, object]]:
        backend = await DockerBackend.start(DockerBackendConfig(owner=TEST_OWNER), sweep=False)
        try:
            client = docker.from_env()
            gold = await run_evaluation(
                shipped, gold_predictions(shipped), run_id="gold", backend=backend, client=client, log_dir=log_dir
            )
            empty = await run_evaluation(
                shipped, empty_predictions(shipped), run_id="empty", backend=backend, client=client, log_dir=log_dir
            )
            return gold, empty
        finally:
            await backend.close()

    t0 = time.monotonic()
    gold, empty = asyncio.run(go())
    return ShippedRuns(shipped, log_dir, gold, empty, time.monotonic() - t0)
