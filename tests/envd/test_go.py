"""envd's Go unit tests (envd/go/*_test.go), run with `go test` in the GOPATH the compiled envd is built in."""

from __future__ import annotations

from pathlib import Path

from orchestrator.images.envd_go import run_tests


def test_go_unit_tests_pass(tmp_path: Path) -> None:
    out = run_tests(tmp_path / "work")
    assert "--- PASS: TestFirstToGoReachesWhatTheCommandForkedBefore" in out, out
