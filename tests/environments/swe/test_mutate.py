"""Bug injection: every operator yields code that parses, differs only where it should, and picks are stable."""

from __future__ import annotations

import ast
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from environments.swe.builder.mutate import OPERATORS, mutants_of, pick
from environments.swe.builder.problem import problem_statement
from environments.swe.snapshot import COMMIT_ENV, extract_archive, snapshot_commit

SOURCE = '''\
def clamp(x, lo, hi):
    """Keep x within [lo, hi]."""
    if x < lo:
        return lo
    elif x > hi:
        return hi
    else:
        return x


def window(seq, n):
    out = []
    for i in range(len(seq) - n + 1):
        if seq and n > 0 and i >= 0:
            out.append(tuple(seq[i : i + n]))
    while not out:
        return divmod(n, 2)
    return out
'''


def test_every_operator_applies_and_parses() -> None:
    mutants = mutants_of("m.py", SOURCE)
    assert {m.operator for m in mutants} == set(OPERATORS)
    for m in mutants:
        ast.parse(m.mutated)
        assert m.mutated != SOURCE and m.function in ("clamp", "window")
        # the docstring is never touched
        assert '"""Keep x within [lo, hi]."""' in m.mutated
    flips = [m for m in mutants if m.operator == "flip_comparison" and m.line == 3]
    assert flips and "if x >= lo:" in flips[0].mutated
    swaps = [m for m in mutants if m.operator == "swap_arguments"]
    assert any("divmod(2, n)" in m.mutated for m in swaps)


def test_pick_is_deterministic_and_spreads_over_functions() -> None:
    mutants = mutants_of("m.py", SOURCE)
    a = pick(mutants, 2, random.Random(7))
    b = pick(mutants, 2, random.Random(7))
    assert [m.key for m in a] == [m.key for m in b]
    assert {m.function for m in a} == {"clamp", "window"}


def test_problem_statement_shows_failures_not_fixes() -> None:
    log = (
        "______________________________ test_clamp ______________________________\n"
        "tests/test_m.py:3: in test_clamp\n    assert clamp(-1, 0, 5) == 0\n"
        "E   assert -1 == 0 at 0x7f3a2b1c9d80\n"
        "=========================== short test summary info ============================\n"
        "FAILED tests/test_m.py::test_clamp - assert -1 == 0\n"
    )
    text = problem_statement("demo", ["tests/test_m.py::test_clamp"], log, "pytest")
    assert "tests/test_m.py::test_clamp" in text and "assert -1 == 0 at 0x..." in text
    assert "x < lo" not in text


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git on the host")
def test_snapshot_hash_equals_git(tmp_path: Path) -> None:
    import io
    import tarfile

    archive = tmp_path / "p-1.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for name, data, mode in [("p-1/a.py", b"x = 1\n", 0o644), ("p-1/sub/run.sh", b"#!/bin/sh\n", 0o755)]:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tf.addfile(info, io.BytesIO(data))
    tree = tmp_path / "tree"
    extract_archive(archive, tree)
    ours = snapshot_commit(tree)
    env = {**COMMIT_ENV, "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "init", "-q"], cwd=tree, check=True, env=env)
    subprocess.run(["git", "add", "-A"], cwd=tree, check=True, env=env)
    t = subprocess.run(["git", "write-tree"], cwd=tree, check=True, env=env, capture_output=True, text=True).stdout
    c = subprocess.run(
        ["git", "commit-tree", t.strip()],
        cwd=tree,
        env=env,
        input="envfleet snapshot\n",
        capture_output=True,
        text=True,
    )
    assert c.stdout.strip() == ours
    # an override hashes a changed file without touching the folder
    assert snapshot_commit(tree, {"a.py": b"x = 2\n"}) != ours == snapshot_commit(tree)
