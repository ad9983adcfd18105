"""`swe-build` from scratch on a small subset (one project, two instances), as CI runs it: the sdist is fetched and
checked, the suite runs in a sandbox, mutants are tried, and what comes out validates through the harness and is
exactly what the shipped dataset holds for those instances (the build is deterministic)."""

from __future__ import annotations

from pathlib import Path

import docker

from environments.swe.builder.build import BuildOptions, build_dataset
from environments.swe.builder.pins import load_pins
from environments.swe.instance import SweInstance
from orchestrator.backends.docker.backend import DockerBackend

PROJECT = "cachetools"  # the quickest suite of the pinned projects


async def test_build_a_small_subset(
    backend: DockerBackend, docker_client: docker.DockerClient, shipped: list[SweInstance], tmp_path: Path
) -> None:
    pins = [p for p in load_pins() if p.package == PROJECT]
    messages: list[str] = []
    instances, stats = await build_dataset(
        pins,
        backend=backend,
        client=docker_client,
        options=BuildOptions(instances_per_project=2),
        log_dir=tmp_path,
        progress=messages.append,
    )
    assert len(instances) == 2, (stats, messages)
    assert stats[0].shipped == 2 and stats[0].passing_tests > 100 and stats[0].killed >= 2
    by_id = {i.instance_id: i for i in shipped}
    for inst in instances:
        assert inst.repo == f"pypi/{PROJECT}" and inst.FAIL_TO_PASS and inst.PASS_TO_PASS
        assert inst.patch.startswith("diff --git") and inst.source.setup_patch  # type: ignore[union-attr]
        # deterministic: the same instance as the shipped one, field for field
        assert inst.instance_id in by_id, inst.instance_id
        assert inst == by_id[inst.instance_id]
    # it went through the harness: gold resolved
    assert (tmp_path / "build-validate-gold-1" / "summary.json").is_file()


def test_processes_unpacking_one_pins_source_take_turns(tmp_path: Path) -> None:
    # two `swe-build`s of one pin on one cache: one removed the tree the other was renaming into (ENOTEMPTY) or
    # taking its snapshot of
    import io
    import tarfile
    from concurrent.futures import ThreadPoolExecutor

    from environments.swe.builder.build import _unpack

    archive = tmp_path / "p-1.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for i in range(200):
            info = tarfile.TarInfo(f"p-1/m{i}.py")
            info.size = 6
            tf.addfile(info, io.BytesIO(b"x = 1\n"))
    tree = tmp_path / "src" / "0123456789abcdef"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: _unpack(archive, tree, 1, tmp_path / "locks"), range(8)))
    assert len(list(tree.iterdir())) == 200 and tree.with_name(tree.name + ".complete").is_file()
