"""The committed protobuf/gRPC code must be what `make proto` generates from protos/*.proto."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    (tmp_path / "protos").mkdir()
    protos = sorted((REPO / "protos").glob("*.proto"))
    assert protos, "no .proto files found"
    for p in protos:
        shutil.copy(p, tmp_path / "protos" / p.name)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.", "--pyi_out=."]
        + [f"protos/{p.name}" for p in protos],
        cwd=tmp_path,
        check=True,
    )
    stale = []
    for generated in sorted((tmp_path / "protos").glob("*_pb2*")):
        committed = REPO / "protos" / generated.name
        if not committed.exists() or _content(committed.read_bytes()) != _content(generated.read_bytes()):
            stale.append(generated.name)
    assert not stale, f"generated code is stale, run `make proto`: {stale}"


# the generator's own version, which the code carries as a stamp: a grpcio-tools released since (a clean clone
# installs the newest) is no change of the protos. Its floor is pyproject's (the code checks the runtime against it)
_STAMPS = (
    re.compile(rb"GRPC_GENERATED_VERSION = '[^']*'"),
    re.compile(rb"# Protobuf Python Version: \S+"),
    re.compile(rb"ValidateProtobufRuntimeVersion\([^)]*\)"),
)


def _content(code: bytes) -> bytes:
    for stamp in _STAMPS:
        code = stamp.sub(b"<version>", code)
    return code


@pytest.mark.skipif(shutil.which("buf") is None, reason="buf is not on PATH (`make test` installs it with npm)")
def test_buf_lint_is_clean() -> None:
    # buf.yaml says which of buf's STANDARD rules the v1 wire contract cannot follow, and why
    r = subprocess.run(["buf", "lint"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
