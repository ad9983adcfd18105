"""The committed protobuf/gRPC code must be what `make proto` generates from protos/*.proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
        if not committed.exists() or committed.read_bytes() != generated.read_bytes():
            stale.append(generated.name)
    assert not stale, f"generated code is stale, run `make proto`: {stale}"
