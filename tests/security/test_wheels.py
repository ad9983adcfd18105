"""Wheels are unpacked on the control plane's host (a SWE dataset's pinned requirements, envd's own site): a dataset
names the distributions and their publishers make the bytes. A wheel whose declared sizes are over the limits, or
that unpacks to over MAX_WHEEL_RATIO times its compressed size (a deflate bomb), is refused before a byte is written;
a zip member is never read past its declared size, so the declared sizes are what counts."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from orchestrator.core.errors import ImageBuildError
from orchestrator.images import wheels
from orchestrator.images.wheels import unpack_wheel


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_a_deflate_bomb_wheel_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    bomb = _wheel(tmp_path / "bomb-1.0-py3-none-any.whl", {"bomb/zeros.bin": bytes(96 << 20)})
    assert bomb.stat().st_size < 1 << 20  # 96 MiB of zeros in about 100 KiB
    dest = tmp_path / "site"
    with pytest.raises(ImageBuildError, match=r"wheel bomb-1.0-py3-none-any.whl unpacks to 100663296 bytes from \d+, "):
        unpack_wheel(bomb, dest)
    assert not dest.exists()


def test_a_wheel_over_the_size_or_member_limits_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = _wheel(tmp_path / "big-1.0-py3-none-any.whl", {f"big/{n}.bin": os.urandom(64 << 10) for n in range(4)})
    monkeypatch.setattr(wheels, "MAX_WHEEL_BYTES", 128 << 10)
    with pytest.raises(ImageBuildError, match=r"unpacks to 262144 bytes, over 131072"):
        unpack_wheel(wheel, tmp_path / "a")
    monkeypatch.setattr(wheels, "MAX_WHEEL_BYTES", 1 << 30)
    monkeypatch.setattr(wheels, "MAX_WHEEL_MEMBERS", 3)
    with pytest.raises(ImageBuildError, match=r"has 4 members, over 3"):
        unpack_wheel(wheel, tmp_path / "b")
    monkeypatch.setattr(wheels, "MAX_WHEEL_MEMBERS", 4)
    unpack_wheel(wheel, tmp_path / "c")  # within every limit: unpacked
    assert len(list((tmp_path / "c" / "big").iterdir())) == 4


def test_a_site_whose_wheels_together_are_over_the_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloaded = tmp_path / "wheels"
    downloaded.mkdir()
    for n in range(3):  # each within its own limit
        _wheel(downloaded / f"w{n}-1.0-py3-none-any.whl", {f"w{n}/data.bin": os.urandom(64 << 10)})
    monkeypatch.setattr(wheels, "_download", lambda *args: downloaded)  # what pip download would have fetched
    monkeypatch.setattr(wheels, "MAX_SITE_BYTES", 128 << 10)
    dest = tmp_path / "site"
    with pytest.raises(ImageBuildError, match=r"the wheels of 3 requirements unpack to 196608 bytes, over 131072"):
        wheels.fetch_site(["w0==1.0", "w1==1.0", "w2==1.0"], dest, tmp_path / "cache")
    assert [p.name for p in tmp_path.iterdir() if p.name.lstrip(".").startswith("site")] == []


def test_another_installs_wheels_never_replace_a_site_a_build_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one folder per name, replaced whenever another install's pins changed the wheels: a build that had hashed
    # the old folder sent the new one, and the image was cached under a key of files it does not hold
    for n in range(2):
        (tmp_path / f"wheels{n}").mkdir()
        _wheel(tmp_path / f"wheels{n}" / f"w{n}-1.0-py3-none-any.whl", {f"w{n}/data.bin": b"%d" % n})
    monkeypatch.setattr(wheels, "_download", lambda requirements, *args: tmp_path / f"wheels{requirements[0][1]}")
    first = wheels.fetch_site(["w0==1.0"], tmp_path / "site", tmp_path / "cache")
    second = wheels.fetch_site(["w1==1.0"], tmp_path / "site", tmp_path / "cache")
    assert first != second and first.parent == second.parent == tmp_path
    assert (first / "w0" / "data.bin").read_bytes() == b"0" and not (first / "w1").exists()
    assert wheels.fetch_site(["w0==1.0"], tmp_path / "site", tmp_path / "cache") == first
