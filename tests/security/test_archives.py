"""Archives are unpacked on the host, so every member is resolved against the tree being built: no link chain,
in any order, carries a write outside the destination; members, size and compression ratio are limited."""

from __future__ import annotations

import gzip
import io
import tarfile
import tracemalloc
import zipfile
from pathlib import Path
from typing import Literal

import pytest

from environments.swe import snapshot
from environments.swe.snapshot import SnapshotError, extract_archive


def _tar(path: Path, members: list[tuple[str, str, bytes | str]], mode: Literal["w", "w:gz"] = "w") -> Path:
    """A tar of (kind, name, data or link target) members, kind in file/sym/dir/fifo."""
    with tarfile.open(path, mode) as tf:
        for kind, name, data in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                assert isinstance(data, bytes)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                continue
            if kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, str(data)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            tf.addfile(info)
    return path


ESCAPES = {
    # the link `up` points at the tree's root; `e` goes through it and one more level up
    "link made after the link it goes through": [
        ("sym", "r/d/up", ".."),
        ("sym", "r/d/e", "up/.."),
        ("file", "r/d/e/x", b"pwned"),
    ],
    "link made before the link it goes through": [
        ("sym", "r/d/e", "up/.."),
        ("sym", "r/d/up", ".."),
        ("file", "r/d/e/x", b"pwned"),
    ],
    "a file written over a link": [
        ("sym", "r/d/up", ".."),
        ("sym", "r/d/e", "up/.."),
        ("file", "r/d/e", b"pwned"),
    ],
    "a plain parent link": [("sym", "r/out", ".."), ("file", "r/out/x", b"pwned")],
    # an absolute target outside the tree (the test checks nothing landed there: a name no one else uses)
    "absolute link": [("sym", "r/abs", "/tmp"), ("file", "r/abs/envfleet-archive-escape-canary", b"pwned")],
    "dot-dot member": [("file", "r/../x", b"pwned")],
}


@pytest.mark.parametrize("members", list(ESCAPES.values()), ids=list(ESCAPES))
def test_no_link_chain_writes_outside_the_destination(
    tmp_path: Path, members: list[tuple[str, str, bytes | str]]
) -> None:
    outer = tmp_path / "outer"
    dest = outer / "a" / "dest"
    archive = _tar(tmp_path / "evil.tar", members)
    with pytest.raises(SnapshotError, match=r"outside the tree|out of the tree|unsafe member path"):
        extract_archive(archive, dest, strip=1)
    written = [p for p in tmp_path.rglob("x") if p.is_file()] + [p for p in outer.rglob("*") if p.name == "e"]
    assert all(dest in p.parents or p.is_symlink() for p in written), written
    assert not (outer / "a" / "x").exists() and not (outer / "x").exists()
    assert not Path("/tmp/envfleet-archive-escape-canary").exists()
    # and nothing in the result points out of the tree
    for p in dest.rglob("*") if dest.exists() else []:
        if p.is_symlink():
            assert dest.resolve() in p.resolve().parents or p.resolve() == dest.resolve()


def test_links_inside_the_tree_are_kept(tmp_path: Path) -> None:
    archive = _tar(
        tmp_path / "ok.tar",
        [
            ("dir", "r/pkg", b""),
            ("file", "r/pkg/mod.py", b"x = 1\n"),
            ("sym", "r/link.py", "pkg/mod.py"),
            ("sym", "r/pkg/up", ".."),
            ("file", "r/pkg/up/top.txt", b"top\n"),  # through a link that stays inside: lands at the root
        ],
    )
    dest = tmp_path / "dest"
    extract_archive(archive, dest, strip=1)
    assert (dest / "link.py").read_text() == "x = 1\n" and (dest / "top.txt").read_text() == "top\n"


def test_devices_and_fifos_are_refused(tmp_path: Path) -> None:
    archive = _tar(tmp_path / "fifo.tar", [("fifo", "r/p", b"")])
    with pytest.raises(SnapshotError, match="device or fifo"):
        extract_archive(archive, tmp_path / "dest")


def test_member_count_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot, "MAX_MEMBERS", 100)
    archive = _tar(tmp_path / "many.tar", [("file", f"r/f{i}", b"") for i in range(101)])
    with pytest.raises(SnapshotError, match="more than 100 members"):
        extract_archive(archive, tmp_path / "dest")


def test_total_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot, "MAX_TOTAL_BYTES", 1 << 20)
    archive = _tar(tmp_path / "big.tar", [("file", "r/a", b"a" * (600 << 10)), ("file", "r/b", b"b" * (600 << 10))])
    with pytest.raises(SnapshotError, match="unpacks to more than 1048576 bytes"):
        extract_archive(archive, tmp_path / "dest")
    assert not (tmp_path / "dest" / "b").exists()


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_compression_bomb_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    monkeypatch.setattr(snapshot, "RATIO_FLOOR", 1 << 20)
    zeros = b"\0" * (64 << 20)  # 64 MiB of zeros compress to about 64 KiB: a ratio of about 1000
    if kind == "zip":
        archive = tmp_path / "bomb.zip"
        with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("r/zeros", zeros)
    else:
        archive = _tar(tmp_path / "bomb.tar.gz", [("file", "r/zeros", zeros)], mode="w:gz")
    with pytest.raises(SnapshotError, match="decompression bomb"):
        extract_archive(archive, tmp_path / "dest")
    assert not (tmp_path / "dest" / "zeros").exists()


def test_a_header_that_large_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # a GNU long name (or a pax record) is a header, not a member: tarfile reads it whole before any member is
    # counted, so a 128 MiB one, 128 KiB gzipped, was held in memory by the control plane (a tenant's upload)
    size = 128 << 20
    header = tarfile.TarInfo("././@LongLink")
    header.type, header.size = tarfile.GNUTYPE_LONGNAME, size
    archive = tmp_path / "header.tar.gz"
    with gzip.open(archive, "wb", compresslevel=1) as f:
        f.write(header.tobuf(tarfile.GNU_FORMAT))
        for _ in range(size >> 20):
            f.write(b"a" * (1 << 20))
        f.write(tarfile.TarInfo("r/named-by-it").tobuf(tarfile.GNU_FORMAT) + b"\0" * 1024)  # its member, the end
    limits = snapshot.ArchiveLimits(members=100, total_bytes=8 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(snapshot.ArchiveLimitError, match="tar stream goes on past"):
            extract_archive(archive, tmp_path / "dest", limits=limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak >> 20} MiB held"


def test_a_zips_member_count_is_refused_before_its_index_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ZipFile read the whole central directory first (300,000 empty entries in 24 MiB held 146 MiB), and the member
    # cap counted them only afterwards
    monkeypatch.setattr(snapshot, "MAX_MEMBERS", 100)
    archive = tmp_path / "many.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for i in range(101):
            zf.writestr(f"r/f{i}", b"")
    read: list[int] = []
    real = zipfile.ZipFile._RealGetContents  # type: ignore[attr-defined]

    def reading(self: zipfile.ZipFile) -> None:
        read.append(1)
        real(self)

    monkeypatch.setattr(zipfile.ZipFile, "_RealGetContents", reading)
    with pytest.raises(SnapshotError, match="more than 100 members"):
        extract_archive(archive, tmp_path / "dest")
    # an end record that declares 1 member: the headers are counted, not the record's word
    data = bytearray(archive.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    data[end + 8 : end + 12] = (1).to_bytes(2, "little") * 2
    forged = tmp_path / "forged.zip"
    forged.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="more than 100 members"):
        extract_archive(forged, tmp_path / "dest2")
    assert read == []  # refused before ZipFile read the index
    with zipfile.ZipFile(archive, "w") as zf:
        for i in range(100):
            zf.writestr(f"r/f{i}", b"")
    extract_archive(archive, tmp_path / "dest3")  # at the cap: fine
    assert len(list((tmp_path / "dest3").iterdir())) == 100
