"""The cgroup freezer file a worker writes to is built from the engine's container id and fixed roots: nothing else
becomes that host path, and a link planted where the file should be is not written through."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.backends.docker.freezer import Freezer

CID = "0123456789abcdef" * 4


def _layout(root: Path, group: str, name: str) -> Path:
    f = root / group / name
    f.parent.mkdir(parents=True)
    f.touch()
    return f


@pytest.mark.parametrize(
    "cid",
    [
        "../../../../etc",
        CID[:63],
        CID.upper(),
        CID + "/../" + CID,
        f"{CID}\n",
        "",
    ],
)
def test_only_a_full_container_id_names_a_freezer(tmp_path: Path, cid: str) -> None:
    # even where a file lies at the path that id would name
    target = tmp_path / "docker" / cid / "cgroup.freeze"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.is_dir():
        target.write_text("0\n")
    assert Freezer.of(cid, root=str(tmp_path)) is None


def test_the_layouts_dockerd_uses_are_found(tmp_path: Path) -> None:
    v2 = _layout(tmp_path / "a", f"docker/{CID}", "cgroup.freeze")
    v1_systemd = _layout(tmp_path / "b" / "freezer", f"system.slice/docker-{CID}.scope", "freezer.state")
    for root, file, frozen in ((tmp_path / "a", v2, "1"), (tmp_path / "b", v1_systemd, "FROZEN")):
        f = Freezer.of(CID, root=str(root))
        assert f is not None and f.path == str(file)
        assert f.freeze() and file.read_text() == frozen
    assert Freezer.of(CID, root=str(tmp_path / "none")) is None


def test_a_link_where_the_freezer_file_should_be_is_not_written_through(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep\n")
    link = tmp_path / "docker" / CID / "cgroup.freeze"
    link.parent.mkdir(parents=True)
    link.symlink_to(elsewhere)
    f = Freezer.of(CID, root=str(tmp_path))
    assert f is not None
    assert not f.freeze() and not f.frozen
    assert elsewhere.read_text() == "keep\n"
