"""`envfleet view FILE.jsonl` and `envfleet serve --ui-port` as the user runs them: real subprocesses, real HTTP."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from orchestrator.testing.synthetic_rollouts import long_rollout, many_rollouts
from tests.conftest import REPO, TEST_OWNER
from tests.viewer.conftest import write_jsonl

CLI = (sys.executable, "-m", "orchestrator.cli")


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _first_line_with(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for _ in range(5):
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
    proc.kill()
    raise AssertionError(f"no {prefix!r} line; stderr: {proc.stderr.read() if proc.stderr else ''}")


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait(30)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def test_view_serves_a_file_of_rollouts(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rollouts.jsonl", [*many_rollouts(40), long_rollout(turns=10)])
    proc = _start("view", str(path), "--port", "0")
    try:
        url = _first_line_with(proc, "viewing ").split(" at ", 1)[1].split()[0]
        jobs = _fetch(url)
        assert "job-many" in jobs and "job-long" in jobs and "40/40" in jobs
        page = _fetch(url + "job/job-many?status=OK")
        table = page.split('id="rollouts"', 1)[1]
        assert "page <b>1</b>" in page and "s-OK" in table and "INFRA_ERROR" not in table
    finally:
        _stop(proc)


def test_every_link_of_a_job_page_opens(tmp_path: Path) -> None:
    # href() quoted the ids that seg() had quoted already: a rollout id's ':' went out as %253A, the server unquoted
    # it once, and every rollout and group link answered 404
    path = write_jsonl(tmp_path / "rollouts.jsonl", [*many_rollouts(12), long_rollout(turns=3)])
    proc = _start("view", str(path), "--port", "0")
    try:
        url = _first_line_with(proc, "viewing ").split(" at ", 1)[1].split()[0].rstrip("/")
        links = set()
        for page in ("/", "/job/job-many", "/job/job-long"):
            links |= {html.unescape(h) for h in re.findall(r'href="(/[^"]*)"', _fetch(url + page))}
        drill = sorted(h for h in links if "/rollout/" in h or "/group/" in h)
        assert any("/rollout/" in h for h in drill) and any("/group/" in h for h in drill), sorted(links)
        for h in sorted(links):
            assert "%25" not in h, h  # quoted once
            _fetch(url + h)  # raises HTTPError on a 404
    finally:
        _stop(proc)


def test_view_off_loopback_is_refused_without_insecure(tmp_path: Path) -> None:
    # plain HTTP, no tokens: `serve --ui-host` refused a host off loopback, `view --host 0.0.0.0` served every rollout
    path = write_jsonl(tmp_path / "rollouts.jsonl", list(many_rollouts(2)))
    argv = [*CLI, "view", str(path), "--host", "0.0.0.0", "--port", "0"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 1 and "refusing to serve on '0.0.0.0'" in proc.stderr and "--insecure" in proc.stderr
    proc2 = _start("view", str(path), "--host", "0.0.0.0", "--port", "0", "--insecure")
    try:
        assert "viewing " in _first_line_with(proc2, "viewing ")
    finally:
        _stop(proc2)


def test_view_names_a_file_that_is_not_rollouts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\nnot json\n')
    done = subprocess.run([*CLI, "view", str(bad), "--port", "0"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 1 and f"{bad}:2: not a rollout" in done.stderr


def test_serve_ui_port_serves_the_viewer(tmp_path: Path) -> None:
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}  # the fake backend needs no engine
    args = ["serve", "--port", "0", "--metrics-port", "-1", "--workers", "0", "--backend", "fake"]
    proc = subprocess.Popen(
        [*CLI, *args, "--data-dir", str(tmp_path), "--owner", TEST_OWNER, "--ui-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        url = _first_line_with(proc, "ui ").split()[1]
        assert "No jobs yet" in _fetch(url)
        with pytest.raises(urllib.error.HTTPError, match="404"):
            _fetch(url + "job/nope")
    finally:
        _stop(proc)
