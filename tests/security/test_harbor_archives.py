"""Uploaded Harbor archives (EnvironmentService.RegisterArchive) are tenant input: unpacked on the control plane with
every member and link resolved inside the tree, under size caps that answer RESOURCE_EXHAUSTED naming the cap, with
the tasks' Dockerfiles held to the rules of any tenant build, and the environment private to its tenant."""

from __future__ import annotations

import io
import re
import secrets
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from environments.harbor.archive import pack
from environments.swe.snapshot import SnapshotError, extract_archive
from orchestrator.client.sdk import EnvfleetClient
from protos import orchestrator_pb2 as pb
from tests.environments.harbor.test_harbor import make_task
from tests.orchestrator.servers import FAKE, expect_error, serve

TOKEN_A, TOKEN_B = (secrets.token_urlsafe(24) for _ in range(2))
CANARY = "envfleet-harbor-escape-canary"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(f"tokens:\n  {TOKEN_A}: team-a\n  {TOKEN_B}: team-b\n")
    return path


def _members(task: Path) -> Iterator[tuple[str, str, bytes | str]]:
    for p in sorted(task.rglob("*")):
        if p.is_file():
            yield "file", f"{task.name}/{p.relative_to(task).as_posix()}", p.read_bytes()


def _tar(members: list[tuple[str, str, bytes | str]]) -> bytes:
    """A tar of (kind, name, data or link target) members, kind file or sym, in the order given."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for kind, name, data in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                assert isinstance(data, bytes)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                info.type, info.linkname = tarfile.SYMTYPE, str(data)
                tf.addfile(info)
    return buf.getvalue()


def _upload(data: bytes, name: str = "evil", kind: str = "harbor") -> pb.EnvironmentArchive:
    return pb.EnvironmentArchive(kind=kind, name=name, archive=data)


def _nothing_left(data_dir: Path, tenant: str = "team-a") -> None:
    """A refused upload leaves no staging folder, tree, archive or record behind."""
    folder = data_dir / "environments" / "archives" / tenant
    left = list(folder.iterdir()) if folder.exists() else []
    assert left == [], left


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def task(tmp_path: Path) -> Path:
    return make_task(tmp_path / "src", "t")


async def _refused(
    tmp_path: Path, token_file: Path, upload: pb.EnvironmentArchive, code: grpc.StatusCode, *fragments: str, **cfg: Any
) -> str:
    data = tmp_path / "data"
    async with (
        serve(data, backend=FAKE, security={"token_file": token_file}, **cfg) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
    ):
        details = await expect_error(a.env_stub.RegisterArchive(upload), code, *fragments)
        await expect_error(a.env_stub.ValidateArchive(upload), code, *fragments)
        names = {e.name for e in (await a.env_stub.List(pb.ListEnvironmentsRequest())).environments}
        assert upload.name not in names
    _nothing_left(data)
    return details


ESCAPES: dict[str, tuple[list[tuple[str, str, bytes | str]], str]] = {
    "dot-dot member": ([("file", "t/../../" + CANARY, b"pwned")], "unsafe member path"),
    "absolute member": ([("file", f"/tmp/{CANARY}", b"pwned")], "unsafe member path"),
    "link out of the tree": (
        [("sym", "t/tests/up", "../../../.."), ("file", f"t/tests/up/{CANARY}", b"pwned")],
        "points outside the tree",
    ),
    "absolute link": ([("sym", "t/abs", "/tmp"), ("file", f"t/abs/{CANARY}", b"pwned")], "points outside the tree"),
    "link chain": (
        # `e` looks inward when made; `up`, made after it, turns it outward (through `up`, one level above the root)
        [("sym", "t/d/e", "up/.."), ("sym", "t/d/up", "../.."), ("file", f"t/d/e/{CANARY}", b"pwned")],
        "outside the tree",
    ),
}


@pytest.mark.parametrize("case", list(ESCAPES), ids=list(ESCAPES))
async def test_a_path_or_link_escape_is_refused(tmp_path: Path, token_file: Path, task: Path, case: str) -> None:
    evil, message = ESCAPES[case]
    upload = _upload(_tar([*_members(task), *evil]))
    details = await _refused(tmp_path, token_file, upload, grpc.StatusCode.INVALID_ARGUMENT, message)
    assert details.startswith("the archive is refused"), details
    assert not [p for p in tmp_path.rglob(CANARY)] and not Path("/tmp", CANARY).exists()


async def test_a_link_inside_a_task_is_refused_as_a_task_file(tmp_path: Path, token_file: Path, task: Path) -> None:
    # inside the tree, yet Harbor's loader copies files only: a link in tests/ would be read through on upload
    upload = _upload(_tar([*_members(task), ("sym", "t/tests/link.sh", "test.sh")]))
    await _refused(tmp_path, token_file, upload, grpc.StatusCode.INVALID_ARGUMENT, "tests/link.sh is a symlink")


@pytest.mark.parametrize(
    ("caps", "extra", "cap"),
    [
        ({"member_bytes": 64 << 10}, [("file", "t/tests/big.bin", b"x" * (100 << 10))], "caps.archive.member_bytes"),
        ({"members": 10}, [("file", f"t/tests/f{i}", b"") for i in range(10)], "caps.archive.members"),
        (
            {"unpacked_bytes": 96 << 10},
            [("file", f"t/tests/f{i}.bin", b"x" * (40 << 10)) for i in range(3)],
            "caps.archive.unpacked_bytes",
        ),
        ({"bytes": 64 << 10}, [("file", "t/tests/noise.bin", secrets.token_bytes(80 << 10))], "caps.archive.bytes"),
    ],
    ids=["member", "members", "unpacked", "archive"],
)
async def test_an_archive_over_a_cap_is_resource_exhausted_naming_it(
    tmp_path: Path, token_file: Path, task: Path, caps: dict[str, int], extra: list[Any], cap: str
) -> None:
    upload = _upload(_tar([*_members(task), *extra]))
    await _refused(tmp_path, token_file, upload, grpc.StatusCode.RESOURCE_EXHAUSTED, cap, caps={"archive": caps})


BAD_TASKS: dict[str, tuple[dict[str, Any], str]] = {
    "FROM a foreign image": ({"dockerfile": "FROM ubuntu:24.04\nRUN true\n"}, "not an envfleet image"),
    "ADD of a URL": (
        {"dockerfile": "FROM envfleet/base:latest\nADD https://example.com/x.tgz /opt/\n"},
        "the daemon would fetch it on the host network",
    ),
    "FROM another environment's image": (
        {"dockerfile": "FROM envfleet/env-harbor-victim:0123456789ab\nRUN true\n"},
        "another environment's image",
    ),
    "a syntax directive": ({"dockerfile": "# syntax=docker/dockerfile:1\nFROM envfleet/base:latest\n"}, "syntax"),
    "COPY out of the context": (
        {"dockerfile": "FROM envfleet/base:latest\nCOPY ../../secret /app/\n"},
        "leaves the build context",
    ),
    "docker_image of another environment": (
        {"toml_extra": 'docker_image = "envfleet/env-victim:0123456789ab"\n'},
        "another environment's image",
    ),
    "a network": ({"toml_extra": 'network_mode = "bridge"\n'}, "sandboxes have no network"),
    "a verifier timeout over the cap": ({"verifier_timeout": 9_999}, "over 3600"),  # under the day load_task takes
}


@pytest.mark.parametrize("case", list(BAD_TASKS), ids=list(BAD_TASKS))
async def test_a_bad_task_is_refused_naming_it(tmp_path: Path, token_file: Path, case: str) -> None:
    kwargs, message = BAD_TASKS[case]
    bad = make_task(tmp_path / "src", "bad-task", **kwargs)
    upload = _upload(_tar(list(_members(bad))))
    details = await _refused(tmp_path, token_file, upload, grpc.StatusCode.INVALID_ARGUMENT, message)
    assert "task bad-task" in details, details


def _replaced(task: Path, name: str, *members: tuple[str, str, bytes | str]) -> list[tuple[str, str, bytes | str]]:
    """The task's members, `name` (a path under the task) left out and `members` added."""
    return [m for m in _members(task) if m[1] != f"{task.name}/{name}"] + list(members)


def _linked_copies(task: Path, n: int) -> list[tuple[str, str, bytes | str]]:
    """n tasks more, each a folder of links to `task`'s parts: read n times over, counted once."""
    parts = ("task.toml", "instruction.md", "environment", "tests", "solution")
    return [("sym", f"c{i}/{part}", f"../{task.name}/{part}") for i in range(n) for part in parts]


# each was INTERNAL (an error no handler expected), or read the same bytes again for every task that linked to them
BAD_FILES: dict[str, tuple[list[tuple[str, str, bytes | str]] | str, str]] = {
    "parts linked to another task's": ("linked", "is a symlink"),
    "task.toml not UTF-8": ("toml-bytes", "task.toml is not UTF-8 text"),
    "task.toml a folder": ("toml-folder", "task.toml cannot be read as a file"),
    "task.toml nested deep": ("toml-deep", "task.toml: nested too deeply"),
    "task.toml a huge integer": ("toml-int", "task.toml: "),
    "a file name not UTF-8": ("name-bytes", "holds a file whose name is not UTF-8"),
    "a task id with a newline": ("id-newline", "is not a valid task id"),
}


@pytest.mark.parametrize("case", list(BAD_FILES), ids=list(BAD_FILES))
async def test_task_files_that_are_links_or_not_text_are_refused(
    tmp_path: Path, token_file: Path, task: Path, case: str
) -> None:
    how, message = BAD_FILES[case]
    members = {
        "linked": list(_members(task)) + _linked_copies(task, 3),
        "toml-bytes": _replaced(task, "task.toml", ("file", "t/task.toml", b"\xff\xfe")),
        "toml-folder": _replaced(task, "task.toml", ("file", "t/task.toml/x", b"")),
        "toml-deep": _replaced(task, "task.toml", ("file", "t/task.toml", ("x = " + "[" * 5000 + "]" * 5000).encode())),
        "toml-int": _replaced(task, "task.toml", ("file", "t/task.toml", ("x = " + "9" * 5000).encode())),
        "name-bytes": [*_members(task), ("file", "t/environment/\udcff", b"x")],
        "id-newline": [(kind, name.replace("t/", "t\n/", 1), data) for kind, name, data in _members(task)],
    }[str(how)]
    await _refused(tmp_path, token_file, _upload(_tar(members)), grpc.StatusCode.INVALID_ARGUMENT, message)


def test_a_zip_member_that_cannot_be_read_is_refused(tmp_path: Path) -> None:
    # an encrypted member, or one compressed with a method zipfile does not read: RuntimeError and
    # NotImplementedError, each an INTERNAL
    archive = tmp_path / "odd.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("t/task.toml", b"x = 1\n")
    data = bytearray(archive.read_bytes())
    for at in (6, data.rindex(b"PK\x01\x02") + 8):  # the local header's and the central directory's flags
        data[at] |= 0x1  # encrypted
    archive.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=r"t/task\.toml.* cannot be read"):
        extract_archive(archive, tmp_path / "dest")


async def test_malformed_uploads_are_refused(tmp_path: Path, token_file: Path, task: Path) -> None:
    good = _tar(list(_members(task)))
    cases = [
        (_upload(good, kind="zipfile"), "no archives of kind 'zipfile'; it reads: harbor"),
        (_upload(good, name="Bad Name"), "name"),
        (_upload(b"not an archive at all"), "not a readable tar"),
        (_upload(_tar([*_members(task), ("file", "README", b"hi")])), "only task folders"),
    ]
    for upload, message in cases:
        await _refused(tmp_path, token_file, upload, grpc.StatusCode.INVALID_ARGUMENT, message)


async def test_limits_over_the_sandbox_caps_are_refused(tmp_path: Path, token_file: Path, task: Path) -> None:
    upload = _upload(_tar(list(_members(task))))  # the task asks for memory_mb = 768
    await _refused(
        tmp_path,
        token_file,
        upload,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "memory_mb = 768 is over caps.sandbox.memory_mb = 512",
        caps={"sandbox": {"memory_mb": 512}},
    )


async def test_a_small_archive_that_unpacks_large_counts_its_tree(tmp_path: Path, token_file: Path, task: Path) -> None:
    # 4 MiB of zeros pack into a few KiB: the tenant's cap counted only the archives as sent, while every unpacked
    # tree stays on the control plane's disk (and a copy on each worker), so a tenant could keep ~250x its cap
    (task / "environment" / "zeros.bin").write_bytes(bytes(4 << 20))
    archive = pack([task])
    assert len(archive) < 64 << 10
    data = tmp_path / "data"
    async with (
        serve(
            data, backend=FAKE, security={"token_file": token_file}, caps={"archive": {"bytes_per_tenant": 1 << 20}}
        ) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
    ):
        details = await expect_error(
            a.env_stub.RegisterArchive(_upload(archive)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "more, with its unpacked tree, would be over caps.archive.bytes_per_tenant = 1048576",
        )
        assert "keeps 4194" in details  # the tree it unpacked, counted
    _nothing_left(data)


async def test_an_uploaded_environment_is_private_to_its_tenant(
    tmp_path: Path, base_image: str, token_file: Path, task: Path
) -> None:
    archive = pack([task])
    cap = (len(archive) + _tree_bytes(task)) * 3 // 2  # room for this archive and its tree, not for a second one
    async with (
        serve(
            tmp_path / "data", security={"token_file": token_file}, caps={"archive": {"bytes_per_tenant": cap}}
        ) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        await a.env_stub.RegisterArchive(_upload(archive, name="a-harbor"))
        names_a = {e.name for e in (await a.env_stub.List(pb.ListEnvironmentsRequest())).environments}
        names_b = {e.name for e in (await b.env_stub.List(pb.ListEnvironmentsRequest())).environments}
        assert "a-harbor" in names_a and "a-harbor" not in names_b
        missing = "no environment named 'a-harbor'"
        for call in (
            b.env_stub.Describe(pb.DescribeEnvironmentRequest(name="a-harbor@1")),
            b.session_stub.Reset(pb.ResetRequest(env="a-harbor", task_id="t")),
            b.sandbox_stub.Create(pb.CreateSandboxRequest(env="a-harbor@1")),
            b.rollout_stub.SubmitJob(
                pb.JobSpec(
                    env="a-harbor",
                    tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_ALL),
                    policy=pb.PolicyEndpoint(base_url="http://127.0.0.1:9/v1", model="m"),
                )
            ),
        ):
            details = await expect_error(call, grpc.StatusCode.NOT_FOUND, missing)
            assert "a-harbor" not in details.split(missing, 1)[1], details  # no "did you mean" either
        # nor can B take the name, even with the very same archive
        await expect_error(
            b.env_stub.RegisterArchive(_upload(archive, name="a-harbor")),
            grpc.StatusCode.PERMISSION_DENIED,
            "belongs to another tenant",
        )
        # A's own sessions work, and A's store is capped
        session = await a.session_stub.Reset(pb.ResetRequest(env="a-harbor", task_id="t"))
        await a.session_stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id))
        (task / "instruction.md").write_text("Another task now.\n")
        await expect_error(
            a.env_stub.RegisterArchive(_upload(pack([task]), name="a-harbor-2")),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "caps.archive.bytes_per_tenant",
        )


def test_task_toml_depth_is_read_before_it_is_parsed_and_strings_do_not_count() -> None:
    # refused only by the RecursionError tomllib raised thousands of frames deep, where a garbage collection that ran
    # a failing finalizer could not report it (a clean-clone run failed so): the depth is read first, and brackets
    # in strings and comments are no nesting
    from environments.harbor.task import MAX_TOML_DEPTH, _nested_deeper

    assert _nested_deeper("x = " + "[" * 5000 + "]" * 5000, MAX_TOML_DEPTH)
    assert not _nested_deeper("x = " + "[" * MAX_TOML_DEPTH + "]" * MAX_TOML_DEPTH, MAX_TOML_DEPTH)
    texts = [
        'x = "' + "[" * 100 + '"\n[a]\ny = 1\n[[b]]\nz = {c = [1, [2]]}',
        "x = '''" + "[" * 100 + "'''\n# " + "{" * 100 + "\ny = 'a[['",
        'x = "a\\"' + "[" * 100 + '"',
        'x = """\n' + "{" * 100 + '\n"""',
    ]
    for text in texts:
        assert not _nested_deeper(text, MAX_TOML_DEPTH), text[:20]


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ("network_mode.a = 1\n", "network_mode = a dict: envfleet sandboxes have no network"),
        ("memory_mb = 8\n", "memory_mb = 8 is under 16"),  # a pydantic error naming no task, for the whole import
        ("memory_mb = 0.5\n", "memory_mb = 0.5 is under 16"),  # int(0.5): the default, silently
        ("cpus = 0.001\n", "cpus = 0.001 is under 0.01"),
        ("cpus = 2000\n", "cpus = 2000 is over 1024"),  # past a sandbox's most: the same message naming no task
        ('memory = "2T"\n', "memory_mb = 2097152.0 is over 1048576"),
        ("storage_mb = 5000000\n", "storage_mb = 5000000 is over 1048576"),
        ('memory = "lots"\n', "memory = 'lots': give memory_mb"),
        ("build_timeout_sec = 1e10\n", "build_timeout_sec = 10000000000.0 is over 86400s"),  # OverflowError
    ],
)
def test_task_toml_settings_the_sandbox_cannot_honour_are_refused_by_name(
    tmp_path: Path, environment: str, message: str
) -> None:
    from environments.harbor.task import HarborTaskError, load_task
    from tests.environments.harbor.test_harbor import TOML

    d = make_task(tmp_path, "t")
    head = TOML.split("[environment]")[0].format(verifier_timeout=60)
    (d / "task.toml").write_text(head + "[environment]\n" + environment)
    with pytest.raises(HarborTaskError, match=re.escape(f"task t: [environment] {message}")):
        load_task(d)


@pytest.mark.parametrize("key", ["network_mode" + ".a" * 50_000 + " = 1", "[environment" + ".a" * 50_000 + "]"])
def test_a_table_nested_by_dotted_keys_is_refused_before_it_is_parsed(tmp_path: Path, key: str) -> None:
    # tomllib took 20-40 s over 50,000 dotted levels (a 100 KB task.toml), and repr() of the table in the refusal
    # raised RecursionError: INTERNAL
    from environments.harbor.task import HarborTaskError, load_task
    from tests.environments.harbor.test_harbor import TOML

    d = make_task(tmp_path, "deep")
    (d / "task.toml").write_text(TOML.format(verifier_timeout=60) + key + "\n")
    with pytest.raises(HarborTaskError, match=r"task deep: task\.toml: nested too deeply \(over 64 levels\)"):
        load_task(d)


def test_harbors_older_sizes_are_read_and_what_a_sandbox_lacks_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # memory = "2G" was ignored (the default used); allow_internet = true (Harbor's default), GPUs, another os and a
    # compose file were ignored without a word: said now, and the oracle's run shows whether the task works without
    # (refused, an archive registered before was dropped at the next start)
    from environments.harbor.task import load_task
    from tests.environments.harbor.test_harbor import TOML

    d = make_task(tmp_path, "sizes")
    head = TOML.split("[environment]")[0].format(verifier_timeout=60)
    settings = 'memory = "2G"\nstorage = "512M"\nallow_internet = true\ngpus = 1\nos = "windows"\n'
    (d / "task.toml").write_text(head + "[environment]\n" + settings)
    (d / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    with caplog.at_level("WARNING", logger="environments.harbor.task"):
        t = load_task(d)
    assert (t.memory_mb, t.storage_mb) == (2048, 512)
    assert "allow_internet = True, gpus = 1, os = 'windows'" in caplog.text
    assert "environment/docker-compose.yaml is not read" in caplog.text
