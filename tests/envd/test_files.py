"""envd's file API against a real envd subprocess: round trips, tar, and symbolic links that must not be followed."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from orchestrator.backends.envd_transport import EnvdTransport
from orchestrator.core.errors import (
    ArchiveTooLargeError,
    InvalidRequestError,
    SandboxFileError,
    SandboxFileNotFoundError,
    SandboxPermissionError,
)


def _tar(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o640
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


async def test_write_read_round_trip_with_mode(envd_client: EnvdTransport, host_envd: tuple[str, str, Path]) -> None:
    _, _, ws = host_envd
    await envd_client.write_file("a/b/c.sh", b"#!/bin/sh\necho hi\n", mode=0o750)
    assert (ws / "a/b/c.sh").stat().st_mode & 0o777 == 0o750
    assert await envd_client.read_file("a/b/c.sh") == b"#!/bin/sh\necho hi\n"
    assert await envd_client.read_file(str(ws / "a/b/c.sh"), max_bytes=3) == b"#!/"
    r = await envd_client.exec("./a/b/c.sh")
    assert r.stdout == b"hi\n"


async def test_list_and_missing(envd_client: EnvdTransport) -> None:
    await envd_client.write_file("d/x.txt", b"12345")
    await envd_client.exec("mkdir d/sub && ln -s x.txt d/link")
    entries = {e.name: e for e in await envd_client.list_dir("d")}
    assert entries["x.txt"].kind == "file" and entries["x.txt"].size == 5
    assert entries["sub"].kind == "dir"
    assert entries["link"].kind == "symlink" and entries["link"].link_target == "x.txt"
    with pytest.raises(SandboxFileNotFoundError, match="no such file"):
        await envd_client.read_file("d/nope")
    with pytest.raises(SandboxFileError, match="not a directory"):
        await envd_client.list_dir("d/x.txt")
    with pytest.raises(SandboxFileNotFoundError, match="parent directory"):
        await envd_client.write_file("nodir/f", b"", make_parents=False)


async def test_symlinks_are_never_followed(envd_client: EnvdTransport, host_envd: tuple[str, str, Path]) -> None:
    _, _, ws = host_envd
    outside = ws.parent / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host secret")
    os.symlink("/etc/shadow", ws / "shadow")
    os.symlink(str(outside), ws / "hostdir")
    with pytest.raises(SandboxPermissionError, match="symbolic link"):
        await envd_client.read_file("shadow")
    with pytest.raises(SandboxPermissionError, match="symbolic link"):
        await envd_client.read_file("hostdir/secret")
    with pytest.raises(SandboxPermissionError, match="symbolic link"):
        await envd_client.write_file("hostdir/planted", b"x")
    with pytest.raises(SandboxPermissionError, match="symbolic link"):
        await envd_client.write_file("shadow", b"x")
    assert not (outside / "planted").exists()
    assert (outside / "secret").read_text() == "host secret"
    # a download stores the link as a link, never the target's content
    data = await envd_client.download("shadow")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        (m,) = tar.getmembers()
        assert m.issym() and m.linkname == "/etc/shadow"


async def test_tar_upload_download_round_trip(envd_client: EnvdTransport, host_envd: tuple[str, str, Path]) -> None:
    _, _, ws = host_envd
    blob = os.urandom(3 << 20)
    n = await envd_client.upload(_tar({"pkg/a.py": b"print(1)\n", "pkg/big.bin": blob}, {"pkg/l": "a.py"}), "dest")
    assert n == 3
    assert (ws / "dest/pkg/big.bin").read_bytes() == blob
    assert os.readlink(ws / "dest/pkg/l") == "a.py"
    with tarfile.open(fileobj=io.BytesIO(await envd_client.download("dest/pkg"))) as tar:
        names = sorted(tar.getnames())
        assert names == ["pkg", "pkg/a.py", "pkg/big.bin", "pkg/l"]
        f = tar.extractfile("pkg/big.bin")
        assert f is not None and f.read() == blob


async def test_a_download_over_its_cap_stops_where_the_cap_is(
    envd_client: EnvdTransport, host_envd: tuple[str, str, Path]
) -> None:
    # envd built the whole archive before the first chunk and only then was cut off by the caller's count: a sparse
    # file of 64 GiB (or a workspace of gigabytes) was read to its end, past the call's deadline (an INFRA_ERROR, where
    # a snapshot too large falls back to the setup), and kept filling the sandbox's /tmp after the cancel
    _, _, ws = host_envd
    (ws / "big").mkdir()
    (ws / "big/small.txt").write_text("x\n")
    (ws / "big/sparse.bin").touch()
    os.truncate(ws / "big/sparse.bin", 64 << 30)
    with pytest.raises(ArchiveTooLargeError, match=r"the archive of 'big' is over max_bytes = 1048576"):
        await envd_client.download_at_most("big", 1 << 20)
    os.remove(ws / "big/sparse.bin")
    with tarfile.open(fileobj=io.BytesIO(await envd_client.download_at_most("big", 1 << 20))) as tar:
        assert sorted(tar.getnames()) == ["big", "big/small.txt"]


@pytest.mark.parametrize(
    ("members", "links", "message"),
    [
        ({"../escape": b"x"}, {}, "escapes the destination"),
        ({"/etc/passwd": b"x"}, {}, "escapes the destination"),
        ({}, {"evil": "/etc"}, "link out of the destination"),
        ({}, {"evil": "../../.."}, "link out of the destination"),
    ],
)
async def test_tar_upload_refuses_escapes(
    envd_client: EnvdTransport, members: dict[str, bytes], links: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        await envd_client.upload(_tar(members, links), "up")


async def test_tar_upload_never_writes_through_an_existing_link(
    envd_client: EnvdTransport, host_envd: tuple[str, str, Path]
) -> None:
    _, _, ws = host_envd
    outside = ws.parent / "outside2"
    outside.mkdir()
    (ws / "up").mkdir()
    os.symlink(str(outside), ws / "up" / "d")
    with pytest.raises(SandboxPermissionError, match="symbolic link"):
        await envd_client.upload(_tar({"d/planted": b"x"}), "up")
    assert not (outside / "planted").exists()


async def test_upload_of_garbage_is_invalid(envd_client: EnvdTransport) -> None:
    with pytest.raises(InvalidRequestError, match="not a tar archive"):
        await envd_client.upload(b"this is not a tar file" * 100, "g")


@pytest.mark.parametrize("cut", [1024, 4608 + 512 + 50])
async def test_upload_of_a_tar_cut_short_is_invalid_not_an_unavailable_sandbox(
    envd_client: EnvdTransport, cut: int
) -> None:
    # a valid first header and the rest cut off (in the first member's data, or in the second's): UNKNOWN
    # before, which the host reads as a sandbox gone (UNAVAILABLE: a client retries it for ever)
    whole = _tar({"a": b"x" * 4000, "b": b"y" * 100})
    with pytest.raises(InvalidRequestError, match="not a complete tar archive"):
        await envd_client.upload(whole[:cut], f"cut{cut}")


def _tar_of(entries: list[tuple[str, str | bytes]]) -> bytes:
    """A tar of (name, content) in order: bytes is a regular file, str the target of a symbolic link."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, value in entries:
            info = tarfile.TarInfo(name)
            if isinstance(value, str):
                info.type, info.linkname = tarfile.SYMTYPE, value
                tar.addfile(info)
            else:
                info.size, info.mode = len(value), 0o640
                tar.addfile(info, io.BytesIO(value))
    return buf.getvalue()


async def test_tar_upload_keeps_links_that_stay_inside_the_destination(
    envd_client: EnvdTransport, host_envd: tuple[str, str, Path]
) -> None:
    _, _, ws = host_envd
    up = ws / "up"
    tar = _tar_of(
        [
            ("deps/prepared.txt", b"ready\n"),
            ("deps/link", "prepared.txt"),
            ("deps/up", ".."),  # the destination itself
            ("abs", f"{up}/deps/prepared.txt"),  # absolute, and inside the destination
        ]
    )
    for dest in ("up", "up/"):  # a trailing slash names the same destination
        assert await envd_client.upload(tar, dest) == 4
        assert os.readlink(up / "deps/link") == "prepared.txt"
        assert os.readlink(up / "abs") == f"{up}/deps/prepared.txt"
        assert (up / "abs").read_text() == "ready\n"
    # still refused: a sibling that only shares the destination's name as a prefix, and a way out through ".."
    for target in (f"{ws}/upx", f"{up}/../outside", "../../upx/f", "/etc"):
        with pytest.raises(InvalidRequestError, match="link out of the destination"):
            await envd_client.upload(_tar_of([("evil", target)]), "up")
        assert not (up / "evil").is_symlink()


async def test_tar_upload_to_the_root_keeps_every_link_and_never_writes_through_one(
    envd_client: EnvdTransport, host_envd: tuple[str, str, Path]
) -> None:
    """Extracted at "/" (as a group snapshot was), every link lies inside the destination: none is refused, and a
    member under a link extracted earlier is still never written through it."""
    _, _, ws = host_envd
    rel = str(ws).lstrip("/")  # member names relative to "/"
    tar = _tar_of(
        [
            (f"{rel}/deps/prepared.txt", b"ready\n"),
            (f"{rel}/deps/link", "prepared.txt"),
            (f"{rel}/abs", f"{ws}/deps/prepared.txt"),
            (f"{rel}/py", "/usr/bin/python3"),
        ]
    )
    assert await envd_client.upload(tar, "/") == 4
    assert (ws / "deps/link").read_text() == "ready\n"
    assert os.readlink(ws / "abs") == f"{ws}/deps/prepared.txt"
    assert os.readlink(ws / "py") == "/usr/bin/python3"
    outside = ws.parent / "outside3"
    outside.mkdir()
    with pytest.raises(SandboxPermissionError, match="symbolic link"):
        await envd_client.upload(_tar_of([(f"{rel}/d", str(outside)), (f"{rel}/d/planted", b"x")]), "/")
    assert not (outside / "planted").exists()
    with pytest.raises(InvalidRequestError, match="escapes the destination"):
        await envd_client.upload(_tar_of([("../x", b"x")]), "/")


async def test_reading_a_directory_holds_no_descriptor(
    envd_client: EnvdTransport, host_envd: tuple[str, str, Path]
) -> None:
    # the Python envd's fdopen refused a directory's descriptor without closing it: each ReadFile of a directory
    # (a policy's read_file(".")) kept one, and at the sandbox's 4,096 no exec could open its pipes
    sock, _, ws = host_envd
    (ws / "d").mkdir()
    pid = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, sock))

    def open_fds() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    with pytest.raises(SandboxFileError):
        await envd_client.read_file("d")
    before = open_fds()
    for _ in range(50):
        with pytest.raises(SandboxFileError):
            await envd_client.read_file("d")
    assert open_fds() - before < 10


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


async def test_an_upload_with_a_huge_extension_header_is_invalid(envd_client: EnvdTransport) -> None:
    # the Python envd's tarfile read a PAX header's data whole into memory: a few MB of gzip that claimed 2 GiB
    # took envd's memory. Both envds refuse one over 1 MiB (Go's archive/tar always did)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("f.txt")
        info.size, info.pax_headers = 1, {"comment": "x" * (2 << 20)}
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(InvalidRequestError):
        await envd_client.upload(buf.getvalue(), ".")
    with pytest.raises(SandboxFileNotFoundError):
        await envd_client.read_file("f.txt")
