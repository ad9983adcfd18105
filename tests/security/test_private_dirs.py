"""The sweep of private temporary directories in a temp directory shared with hostile accounts: it removes only a
real 0700 directory of this user whose marker of ours names a process that is gone; a link, someone else's
directory, a forged or linked marker, or a live owner's directory is left untouched (nothing removed, nothing
chmod-ed), and a link inside a removed directory is never followed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.core.private_dirs import MAGIC, MARKER, make_private_dir, sweep_private_dirs
from orchestrator.core.processes import proc_start_time, process_host

OTHER_UID = 65534  # nobody: another account of the host


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    """A sticky, world-writable temp directory, like /tmp."""
    d = tmp_path / "tmp"
    d.mkdir()
    d.chmod(0o1777)
    return d


def _dead_owner() -> tuple[int, str]:
    child = subprocess.Popen(["sleep", "30"])
    start = proc_start_time(child.pid)
    child.kill()
    child.wait()
    return child.pid, start


def _marker(pid: int, start: str, host: str | None = None) -> str:
    return json.dumps({"magic": MAGIC, "pid": pid, "start": start, "host": process_host() if host is None else host})


def _planted(tmp: Path, name: str, marker: str, mode: int = 0o700, marker_mode: int = 0o600) -> Path:
    """A directory as a sweep would judge it, made by hand."""
    d = tmp / name
    d.mkdir()
    (d / MARKER).write_text(marker)
    (d / MARKER).chmod(marker_mode)
    d.chmod(mode)
    return d


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under `root` (links not followed) with its mode and owner."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_mode, st.st_uid)
    return out


def test_a_dead_owners_directory_goes_and_a_live_ones_stays(tmp: Path) -> None:
    mine = make_private_dir("workers", tmp)
    assert (mine.stat().st_mode & 0o777) == 0o700 and mine.name.startswith("envfleet-workers-")
    dead = _planted(tmp, "envfleet-workers-dead", _marker(*_dead_owner()))
    pid, start = os.getpid(), proc_start_time(os.getpid())
    reused = _planted(tmp, "envfleet-workers-reused", _marker(pid, str(int(start) - 1)))  # same pid, another start
    archives = _planted(tmp, "envfleet-worker-archives-x", _marker(*_dead_owner()))
    (archives / "sub").mkdir()
    (archives / "sub" / "f").write_text("x")
    assert sorted(sweep_private_dirs(tmp)) == sorted([dead, reused, archives])
    assert mine.is_dir() and (mine / MARKER).is_file()
    assert not dead.exists() and not reused.exists() and not archives.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another account's directory needs root")
def test_another_accounts_directory_is_left_alone(tmp: Path) -> None:
    theirs = _planted(tmp, "envfleet-workers-theirs", _marker(*_dead_owner()))
    os.chown(theirs / MARKER, OTHER_UID, OTHER_UID)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    before = _tree(tmp)
    assert sweep_private_dirs(tmp) == []
    assert _tree(tmp) == before  # not removed, not chmod-ed, not chown-ed


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another account's marker needs root")
def test_a_marker_of_another_account_in_our_directory_is_no_marker(tmp: Path) -> None:
    d = _planted(tmp, "envfleet-workers-forged", _marker(*_dead_owner()))
    os.chown(d / MARKER, OTHER_UID, OTHER_UID)
    assert sweep_private_dirs(tmp) == [] and d.is_dir()


def test_a_link_is_never_followed_nor_removed(tmp: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"  # a directory that looks stale, elsewhere: the link's target
    victim.mkdir(mode=0o700)
    (victim / MARKER).write_text(_marker(*_dead_owner()))
    (victim / MARKER).chmod(0o600)
    (victim / "precious").write_text("keep")
    link = tmp / "envfleet-workers-link"
    link.symlink_to(victim)
    before = _tree(tmp_path)
    assert sweep_private_dirs(tmp) == []
    assert link.is_symlink() and (victim / "precious").read_text() == "keep"
    assert _tree(tmp_path) == before


def test_a_linked_marker_or_one_not_ours_keeps_the_directory(tmp: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "marker-elsewhere"
    elsewhere.write_text(_marker(*_dead_owner()))
    elsewhere.chmod(0o600)
    linked = tmp / "envfleet-workers-linked"
    linked.mkdir(mode=0o700)
    (linked / MARKER).symlink_to(elsewhere)
    wide = _planted(tmp, "envfleet-workers-wide", _marker(*_dead_owner()), mode=0o755)  # not made as we make ours
    loose = _planted(tmp, "envfleet-workers-loose", _marker(*_dead_owner()), marker_mode=0o644)
    unmarked = tmp / "envfleet-workers-unmarked"
    unmarked.mkdir(mode=0o700)
    garbage = _planted(tmp, "envfleet-workers-garbage", "[" * 3000)
    alien = _planted(tmp, "envfleet-workers-alien", _marker(*_dead_owner(), host="elsewhere[4026531836]"))
    huge = _planted(tmp, "envfleet-workers-huge", _marker(*_dead_owner()) + " " * 5000)
    fifo = tmp / "envfleet-workers-fifo"
    fifo.mkdir(mode=0o700)
    os.mkfifo(fifo / MARKER, 0o600)  # a read of it must not block the sweep
    before = _tree(tmp)
    assert sweep_private_dirs(tmp) == []
    assert _tree(tmp) == before
    assert all(d.is_dir() for d in (linked, wide, loose, unmarked, garbage, alien, huge, fifo))
    assert elsewhere.read_text().startswith("{")


def test_a_link_inside_a_removed_directory_is_not_followed(tmp: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    d = _planted(tmp, "envfleet-workers-stale", _marker(*_dead_owner()))
    d.chmod(0o700)
    (d / "into-outside").symlink_to(outside)
    (d / "file-link").symlink_to(outside / "precious")
    assert sweep_private_dirs(tmp) == [d]
    assert not os.path.lexists(d)
    assert (outside / "precious").read_text() == "keep"


def test_a_temp_directory_others_may_rename_in_is_not_swept(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # world-writable and not sticky: an entry judged might be swapped before its removal
    d = _planted(open_dir, "envfleet-workers-stale", _marker(*_dead_owner()))
    assert sweep_private_dirs(open_dir) == [] and d.is_dir()
