"""Declarative environments end to end: validate and register over gRPC, run a job on one, survive a restart, and
refuse every kind of bad spec with the field and the reason, leaving nothing half-registered."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, RolloutStatus, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.service.declarative import SpecError, parse_spec
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import start_scripted_server
from orchestrator.testing.scripts import reference_script
from protos import orchestrator_pb2 as pb
from tests.conftest import REPO
from tests.orchestrator.servers import expect_error, serve

GRADER = """\
import json, sys
episode = json.load(sys.stdin)
expected = str(episode["data"]["expected"])
answer = (episode["answer"] or "").strip()
print("grading", episode["task_id"], file=sys.stderr)
print(json.dumps({"reward": float(answer == expected), "exact": float(answer == expected), "note": "ok"}))
"""
SHELL_GRADER = (
    "python3 -c 'import json, sys; e = json.load(sys.stdin); "
    'print(json.dumps({"reward": float(e["answer"] == e["data"]["word"])}))\''
)
TEXTS = ["alpha beta gamma", "one two three four five", "a b"]


def word_count_spec(name: str = "word-count", version: str = "1") -> dict[str, Any]:
    """A spec as a user writes it (YAML-shaped): an image with a grader, tasks with files and references."""
    return {
        "name": name,
        "version": version,
        "description": "count the words of a file",
        "image": {
            "packages": ["python3", "procps"],
            "files": {"/opt/grader/score.py": GRADER},
            "setup": ["chmod 0755 /opt/grader"],
            "env": {"GRADER_MODE": "strict"},
        },
        "tools": ["bash", "submit"],
        "tasks": [
            {
                "id": f"wc-{i}",
                "prompt": "How many words are in text.txt? Submit the number.",
                "data": {"expected": len(text.split())},
                "files": {"text.txt": text + "\n"},
                "reference": [
                    {"name": "bash", "arguments": {"command": "wc -w < text.txt"}},
                    {"name": "submit", "arguments": {"answer": str(len(text.split()))}},
                ],
            }
            for i, text in enumerate(TEXTS)
        ],
        "scoring": {"command": "python3 /opt/grader/score.py", "timeout_s": 30},
        "limits": {"memory_mb": 256, "pids": 64},
        "max_turns": 6,
        "tool_timeout_s": 20,
    }


def to_pb(d: dict[str, Any]) -> pb.EnvironmentSpec:
    """The wire form of a raw spec dict, without validating it (bad specs must reach the server)."""
    m = pb.EnvironmentSpec(
        name=d.get("name", ""),
        version=d.get("version", ""),
        description=d.get("description", ""),
        tools=d.get("tools", []),
    )
    if "image" in d:
        img = d["image"]
        m.image.CopyFrom(
            pb.ImageSource(
                dockerfile=img.get("dockerfile", ""),
                base=img.get("base", ""),
                packages=img.get("packages", []),
                files=img.get("files", {}),
                setup=img.get("setup", []),
                env=img.get("env", {}),
            )
        )
    for t in d.get("tasks", []):
        m.tasks.append(
            pb.TaskSpec(
                id=t["id"],
                prompt=t["prompt"],
                data_json=json.dumps(t.get("data", {})),
                files=t.get("files", {}),
                reference=[
                    pb.ToolCall(name=c["name"], arguments=json.dumps(c["arguments"])) for c in t.get("reference", [])
                ],
            )
        )
    if "scoring" in d:
        m.scoring.command = d["scoring"].get("command", "")
        for f in ("timeout_s", "min_reference_reward"):
            if f in d["scoring"]:
                setattr(m.scoring, f, d["scoring"][f])
    for k, v in d.get("limits", {}).items():
        setattr(m.limits, k, v)
    for f in ("max_turns", "tool_timeout_s", "system_prompt", "setup_command"):
        if f in d:
            setattr(m, f, d[f])
    return m


async def test_register_validate_and_run_a_job(tmp_path: Path, base_image: str) -> None:
    registry = Registry.from_entry_points()
    spec = to_pb(word_count_spec())
    async with serve(tmp_path / "data", registry) as orch, EnvfleetClient(orch.address) as client:
        report = await client.env_stub.Validate(spec)
        assert (
            report.env == "word-count@1"
            and report.num_tasks == 3
            and report.image.startswith("envfleet/env-word-count:")
        )
        assert report.reference_task_id == "wc-0" and report.reference_reward == 1.0
        assert dict(report.reference_components) == {"exact": 1.0}
        assert "word-count" not in [e.name for e in await client.list_envs()]  # Validate registers nothing

        info = await client.env_stub.Register(spec)
        assert (info.name, info.version, info.num_tasks, info.source) == ("word-count", "1", 3, "spec")
        assert [t.name for t in info.tools] == ["bash", "submit"] and info.default_max_turns == 6
        assert (await client.env_stub.Register(spec)).name == "word-count"  # the same spec again: a no-op
        changed = copy.deepcopy(word_count_spec())
        changed["description"] = "something else"
        await expect_error(client.env_stub.Register(to_pb(changed)), grpc.StatusCode.ALREADY_EXISTS, "bump the version")
        taken = word_count_spec(name="python-tool")
        await expect_error(client.env_stub.Register(to_pb(taken)), grpc.StatusCode.PERMISSION_DENIED, "built-in")

        policy = await start_scripted_server(reference_script(registry.get("word-count")))
        try:
            job_id = await client.submit(
                JobSpec(
                    env="word-count",
                    tasks=TaskSelection(kind="all"),
                    policy=PolicyEndpoint(base_url=policy.url, model="scripted"),
                )
            )
            rollouts = [r async for r in client.rollouts(job_id)]
        finally:
            await policy.close()
        assert sorted(r.task_id for r in rollouts) == ["wc-0", "wc-1", "wc-2"]
        for r in rollouts:
            assert r.status == RolloutStatus.OK and r.reward == 1.0, r.error
            assert r.reward_components == {"exact": 1.0} and r.env == "word-count@1"
            assert r.provenance.image.startswith("envfleet/env-word-count:")

    # a registered spec survives a restart (a fresh registry, the same data dir)
    async with serve(tmp_path / "data", Registry.from_entry_points()) as orch, EnvfleetClient(orch.address) as client:
        again = await client.describe_env("word-count@1")
        assert again.source == "spec" and again.num_tasks == 3
        stub = client.session_stub
        r = await stub.Reset(pb.ResetRequest(env="word-count", task_id="wc-1"))
        s = await stub.Step(pb.StepRequest(session_id=r.session_id, action=pb.Action(final_answer="4")))
        assert s.status == pb.ROLLOUT_STATUS_OK and s.reward == 0.0  # a wrong answer is a scored 0 (wc-1 has 5 words)


def _bad(edit: Any) -> pb.EnvironmentSpec:
    d = word_count_spec(name="bad-env")
    edit(d)
    return to_pb(d)


BAD_SPECS = [
    (lambda d: d.update(tools=["bash", "telnet"]), "tools: unknown tool(s) ['telnet']"),
    (lambda d: d.pop("scoring"), "scoring: Field required"),
    (lambda d: d["scoring"].update(command=""), "scoring.command: String should have at least 1 character"),
    (lambda d: d["limits"].update(memory_mb=0), "limits.memory_mb: Input should be greater than or equal to 16"),
    (lambda d: d["limits"].update(pids=-1), "limits.pids: Input should be greater than or equal to 8"),
    (lambda d: d.update(tool_timeout_s=1e12), "tool_timeout_s: Input should be less than or equal to 3600"),
    (lambda d: d["scoring"].update(timeout_s=1e12), "scoring.timeout_s: Input should be less than or equal to 3600"),
    (lambda d: d["image"]["files"].update({"/opt/../etc/passwd": "x"}), "image.files: file path '/opt/../etc/passwd'"),
    (lambda d: d["tasks"][1]["files"].update({"../../escape": "x"}), "tasks[1].files: task file '../../escape'"),
    (lambda d: d["tasks"][0].update(id="wc-1"), "tasks: task ids are not unique: ['wc-1']"),
    (lambda d: d.update(name="Bad Name"), "name: String should match pattern"),
    (
        lambda d: d.update(image={"dockerfile": "FROM alpine:3\nRUN true"}),
        "image.dockerfile: the final stage is FROM 'alpine:3'",
    ),
    (lambda d: d["tasks"][0]["reference"].append({"name": "python", "arguments": {}}), "which are not in tools"),
]


@pytest.mark.parametrize(("edit", "message"), BAD_SPECS, ids=[m.split(":")[0] for _, m in BAD_SPECS])
async def test_bad_specs_are_refused_naming_the_field(
    fake_client: EnvfleetClient, tmp_path: Path, edit: Any, message: str
) -> None:
    client = fake_client  # refused before any image or sandbox
    for call in (client.env_stub.Validate, client.env_stub.Register):
        details = await expect_error(call(_bad(edit)), grpc.StatusCode.INVALID_ARGUMENT, message)
        assert details.startswith("invalid environment spec")
    assert "bad-env" not in [e.name for e in await client.list_envs()]
    assert not list((tmp_path / "data").glob("environments/bad-env*"))


async def test_every_problem_is_reported_at_once(fake_client: EnvfleetClient) -> None:
    client = fake_client

    def many(d: dict[str, Any]) -> None:
        d.update(tools=["nope"], tool_timeout_s=1e12)
        d.pop("scoring")
        d["limits"].update(memory_mb=0, pids=-1)

    details = await expect_error(client.env_stub.Register(_bad(many)), grpc.StatusCode.INVALID_ARGUMENT, "(5 problems)")
    for field in ("tools", "scoring", "limits.memory_mb", "limits.pids", "tool_timeout_s"):
        assert f"{field}: " in details


async def test_specs_that_do_not_work(client: EnvfleetClient, tmp_path: Path) -> None:
    broken = _bad(lambda d: d.update(image={"dockerfile": "FROM envfleet/base:latest\nRUN echo boom-marker && exit 3"}))
    details = await expect_error(
        client.env_stub.Register(broken), grpc.StatusCode.FAILED_PRECONDITION, "image.dockerfile"
    )
    assert "boom-marker" in details and "last log lines" in details  # the build log's tail
    assert ".log) ---" in details and "/" not in details.split("last log lines (", 1)[1].split(")", 1)[0]  # no path

    garbage = _bad(lambda d: d["scoring"].update(command="echo not-json"))
    await expect_error(
        client.env_stub.Validate(garbage),
        grpc.StatusCode.FAILED_PRECONDITION,
        "scoring.command",
        'finite numeric "reward"',
        "not-json",
    )
    wrong = _bad(lambda d: d["tasks"][0]["reference"][1]["arguments"].update(answer="99"))
    await expect_error(
        client.env_stub.Register(wrong),
        grpc.StatusCode.FAILED_PRECONDITION,
        "tasks[0].reference",
        "scored 0, below scoring.min_reference_reward 1",
    )
    # a grader that never finishes: a rollout's scoring gives its second run past the timeout a 0 (the policy's
    # program may be why), which here passed as the reference's score where min_reference_reward allows it
    hangs = _bad(lambda d: d["scoring"].update(command="sleep 60", timeout_s=1, min_reference_reward=0))
    await expect_error(
        client.env_stub.Register(hangs), grpc.StatusCode.FAILED_PRECONDITION, "scoring.command", "ran past"
    )
    assert "bad-env" not in [e.name for e in await client.list_envs()]
    assert not list((tmp_path / "data").glob("environments/*.json"))


def _envfleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


async def test_register_without_python(client: EnvfleetClient, tmp_path: Path) -> None:
    """A YAML spec, a JSONL task file and the CLI: nothing else."""
    tasks = [
        {
            "id": f"echo-{i}",
            "prompt": f"Submit the word w{i}.",
            "data": {"word": f"w{i}"},
            "reference": [{"name": "submit", "arguments": {"answer": f"w{i}"}}],
        }
        for i in range(2)
    ]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    spec = {
        "name": "echo-word",
        "version": "0.1",
        "tools": ["submit"],
        "tasks_file": "tasks.jsonl",
        "scoring": {"command": SHELL_GRADER},
        "limits": {"memory_mb": 128},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    r = await asyncio.to_thread(
        _envfleet, "envs", "register", str(tmp_path / "spec.yaml"), "--server", client.target, "--dry-run"
    )
    assert (
        r.returncode == 0 and "echo-word@0.1 is valid" in r.stdout and "reference: task echo-0 scored 1" in r.stdout
    ), r.stderr
    r = await asyncio.to_thread(_envfleet, "envs", "register", str(tmp_path / "spec.yaml"), "--server", client.target)
    assert r.returncode == 0 and "registered echo-word@0.1: 2 task(s)" in r.stdout, r.stderr
    assert (await client.describe_env("echo-word")).num_tasks == 2

    spec["limits"] = {"memory_mb": 0}
    (tmp_path / "tasks.jsonl").write_text('{"id": "x"}\n')
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    r = await asyncio.to_thread(_envfleet, "envs", "register", str(tmp_path / "bad.yaml"), "--server", client.target)
    assert r.returncode == 2
    assert "tasks_jsonl line 1.prompt: Field required" in r.stderr and "limits.memory_mb" in r.stderr, r.stderr


async def test_versions_of_any_shape_side_by_side_break_no_registration(fake_client: EnvfleetClient) -> None:
    # `1` and `a` are both versions: sorting them raised TypeError (an int against a str), and since a registration
    # lists every environment, each one after, of any tenant and name, failed with INTERNAL, a restart included
    def spec(name: str, version: str = "1") -> pb.EnvironmentSpec:
        d = word_count_spec(name=name, version=version)
        d["scoring"]["command"] = """echo '{"reward": 1}'"""  # the fake backend echoes it: every reference passes
        return to_pb(d)

    for version in ("1", "a", "1.b", "2"):
        await fake_client.env_stub.Register(spec("shapes", version))
    await fake_client.env_stub.Register(spec("after-them"))
    info = await fake_client.describe_env("shapes")
    assert info.version == "a"  # numbers before words, part by part: 1 < 1.b < 2 < a
    assert {"shapes", "after-them"} <= {e.name for e in await fake_client.list_envs()}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        # registered, it could not be read back by pydantic (about 200 levels): a remote worker failed every rollout
        # of it, and the next start dropped it
        ('{"a":' * 220 + "1" + "}" * 220, "nested too deeply: more than 64 levels"),
        ("9" * 5000, "Exceeds the limit"),
        ('{"a": "\\ud800"}', "lone surrogate escape"),
    ],
    ids=["deep", "deeper-than-pydantic-reads", "long-integer", "lone-surrogate"],
)
async def test_task_json_python_cannot_hold_is_refused_naming_it(
    fake_client: EnvfleetClient, text: str, message: str
) -> None:
    # each was INTERNAL: RecursionError, ValueError, and a spec that validated and then could not be stored
    m = to_pb(word_count_spec(name="odd-json"))
    m.tasks[0].data_json = text
    for call in (fake_client.env_stub.Validate, fake_client.env_stub.Register):
        await expect_error(call(m), grpc.StatusCode.INVALID_ARGUMENT, "tasks[0].data_json: not usable JSON", message)
    jsonl = "\n".join([json.dumps({"id": "a", "prompt": "p"}), '{"id": "b", "prompt": "p", "data": ' + text + "}"])
    with pytest.raises(SpecError, match=rf"tasks_jsonl line 2: not usable JSON: .*{message}"):
        parse_spec(
            {**{k: v for k, v in word_count_spec(name="odd-jsonl").items() if k != "tasks"}, "tasks_jsonl": jsonl}
        )


async def test_a_check_past_its_time_in_all_gives_the_tenants_slot_back(tmp_path: Path) -> None:
    # a check's budgets came from the tenant's own spec (up to 101 x 3600 s for a reference run, an archive's every
    # task on top): two tenants held both check slots for days, and nobody else could Validate or Register
    import time

    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake import FakeBackend
    from orchestrator.service.declarative import SpecCheckError
    from orchestrator.service.registration import Registrar, SpecStore

    builds: list[str] = []

    def slow_build(env: object) -> str:
        builds.append(type(env).__name__)
        time.sleep(3 if len(builds) == 1 else 0)  # the first build hangs past the check's time; the next does not
        return "envfleet/slow-check:1"

    registrar = Registrar(Registry(), FakeBackend(FakeBackendConfig()), slow_build, SpecStore(tmp_path), check_s=1)
    spec = parse_spec(word_count_spec(name="slow-check"))
    t0 = time.monotonic()
    with pytest.raises(SpecCheckError, match=r"did not finish within caps.registration_check_s = 1s"):
        await registrar.validate(spec, "tenant-a")
    assert time.monotonic() - t0 < 2.5
    # the tenant's one check slot is free again: its next check runs once the cut-off check's build has ended
    # (_built), past the build this time (to the fake backend, which has no such image)
    await asyncio.sleep(max(0.0, t0 + 3.2 - time.monotonic()))
    async with asyncio.timeout(10):
        with pytest.raises(SpecCheckError, match="a sandbox of the image did not start"):
            await registrar.validate(spec, "tenant-a")
    assert len(builds) == 2


async def test_cancelled_checks_do_not_pile_up_builds(tmp_path: Path) -> None:
    # a cancelled Validate freed its tenant's slot while its build's thread ran on: cancelling one every 0.2 s ran
    # five builds at once on one slot, each reserving its disk and memory, in the threads the control plane shares
    import threading
    import time

    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake import FakeBackend
    from orchestrator.service.declarative import SpecCheckError
    from orchestrator.service.registration import Registrar, SpecStore

    lock = threading.Lock()
    running, most, builds = 0, 0, 0

    def slow_build(env: object) -> str:
        nonlocal running, most, builds
        with lock:
            running, builds = running + 1, builds + 1
            most = max(most, running)
        time.sleep(1.5)
        with lock:
            running -= 1
        return "envfleet/cut-check:1"

    registrar = Registrar(Registry(), FakeBackend(FakeBackendConfig()), slow_build, SpecStore(tmp_path))
    spec = parse_spec(word_count_spec(name="cut-check"))
    for _ in range(5):
        check = asyncio.create_task(registrar.validate(spec, "tenant-a"))
        await asyncio.sleep(0.2)
        check.cancel()
        await asyncio.gather(check, return_exceptions=True)
    assert (most, builds) == (1, 1)  # the later checks waited for the first one's build, and were cancelled so
    async with asyncio.timeout(10):
        with pytest.raises(SpecCheckError, match="a sandbox of the image did not start"):
            await registrar.validate(spec, "tenant-a")
    assert (most, builds) == (1, 2) and registrar._cut_builds == {}


async def test_a_cancelled_archive_check_leaves_no_staging_behind(tmp_path: Path) -> None:
    # the unpack ran in a thread the cancel could not stop: the staging folder was removed under it, and what it
    # wrote after stayed (256 MiB an upload, uncounted), while the tenant's slot was free for the next
    import threading
    import time

    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake import FakeBackend
    from orchestrator.service.archives import ArchiveStore, ArchiveUpload
    from orchestrator.service.registration import Registrar, SpecStore

    unpacked = threading.Event()

    class SlowKind:
        def load(self, archive: Path, dest: Path, name: str, version: str, limits: object) -> object:
            time.sleep(0.5)
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "task.toml").write_bytes(b"x" * 1000)
            unpacked.set()
            raise ValueError("not an environment")

    archives = ArchiveStore(tmp_path / "archives")
    registrar = Registrar(
        Registry(),
        FakeBackend(FakeBackendConfig()),
        lambda env: "x",
        SpecStore(tmp_path),
        archives=archives,
        kinds={"slow": SlowKind()},  # type: ignore[dict-item]
    )
    check = asyncio.create_task(
        registrar.validate_archive(ArchiveUpload(kind="slow", name="slow-env", data=b"tar"), "tenant-a")
    )
    await asyncio.sleep(0.1)
    check.cancel()
    await asyncio.gather(check, return_exceptions=True)
    assert unpacked.is_set()  # the cancel waited for the unpack, then removed what it wrote
    assert list((tmp_path / "archives").glob("*/.staging-*")) == []


async def test_refused_registrations_under_fresh_names_leave_nothing_behind(tmp_path: Path) -> None:
    # each name tried kept a lock for good: a loop of registrations refused at once (limits over the caps) under
    # fresh names grew the control plane's memory without end
    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake import FakeBackend
    from orchestrator.core.errors import QuotaExceededError
    from orchestrator.service.registration import Registrar, SpecStore

    registrar = Registrar(Registry(), FakeBackend(FakeBackendConfig()), lambda env: "x", SpecStore(tmp_path))
    for i in range(20):
        spec = parse_spec({**word_count_spec(name=f"fresh-{i}"), "limits": {"memory_mb": 1 << 20}})
        with pytest.raises(QuotaExceededError, match=r"caps\.sandbox\.memory_mb"):
            await registrar.register(spec, "tenant-a")
    assert registrar._locks == {}


async def test_a_checks_build_runs_off_the_shared_thread_pool(tmp_path: Path) -> None:
    # checks built on asyncio's shared pool (6 threads on 2 cores): a few tenants' cut-off checks, each building on
    # for up to 15 minutes, held every thread, and each sandbox's create, the sweep and SubmitJob waited behind them
    import threading

    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake import FakeBackend
    from orchestrator.service.declarative import SpecCheckError
    from orchestrator.service.registration import Registrar, SpecStore

    threads: list[str] = []

    def build(env: object) -> str:
        threads.append(threading.current_thread().name)
        return "envfleet/threaded-check:1"

    registrar = Registrar(Registry(), FakeBackend(FakeBackendConfig()), build, SpecStore(tmp_path))
    with pytest.raises(SpecCheckError):  # the fake backend has no such image: the build is what this looks at
        await registrar.validate(parse_spec(word_count_spec(name="threaded-check")), "tenant-a")
    assert len(threads) == 1 and threads[0].startswith("check-build"), threads


async def test_a_check_cut_while_its_build_waits_for_a_thread_builds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a build queued behind others' (the checks' threads held by cut-off checks building on) ran when its turn came,
    # for a check long gone, and its tenant's next check waited for it
    import threading
    import time

    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake import FakeBackend
    from orchestrator.service import registration
    from orchestrator.service.declarative import SpecCheckError

    monkeypatch.setattr(registration, "CHECK_BUILD_THREADS", 1)
    release = threading.Event()
    started: list[str] = []

    def build(env: object) -> str:
        started.append(type(env).__name__)
        release.wait(30)
        return "envfleet/queued-check:1"

    registrar = registration.Registrar(
        Registry(), FakeBackend(FakeBackendConfig()), build, registration.SpecStore(tmp_path), check_s=1
    )
    spec = parse_spec(word_count_spec(name="queued-check"))
    for tenant in ("tenant-a", "tenant-b"):  # a's build holds the one thread; b's waits for it, and is cut there
        with pytest.raises(SpecCheckError, match="did not finish within"):
            await registrar.validate(spec, tenant)
    release.set()
    await asyncio.sleep(0.5)
    time.sleep(0.1)
    assert len(started) == 1


def test_a_start_sweeps_what_a_killed_registration_left(tmp_path: Path) -> None:
    # a process killed mid-registration left: a spec's temporary copy (whole, ending in .json: the next start
    # registered it, for a call that had failed), an archive and its unpacked tree with no record (counted against
    # the tenant's cap for good), and an archive store's temporary copy
    from orchestrator.core.files import write_atomically
    from orchestrator.service.archives import ArchiveStore, StoredArchive
    from orchestrator.service.registration import SpecStore, StoredSpec

    specs = SpecStore(tmp_path / "specs")
    kept = StoredSpec(spec=parse_spec(word_count_spec(name="kept")), owner="tenant-a", registered_at=1.0)
    specs.save(kept)
    killed = kept.model_copy(update={"spec": parse_spec(word_count_spec(name="killed"))})
    (specs.root / ".tmp-x1y2.json").write_text(killed.model_dump_json())  # the old save's copy, before its rename
    (specs.root / ".tmp-z3").write_text(killed.model_dump_json())
    assert [r.spec.name for r in specs.load_all()] == ["kept"]
    assert sorted(p.name for p in specs.root.iterdir()) == [f"{kept.spec.ref()}.json"]

    archives = ArchiveStore(tmp_path / "archives")
    digest = "0" * 64
    record = StoredArchive(
        owner="tenant-a", registered_at=1.0, kind="k", name="a", version="1.tar", digest=digest, size=3
    )
    archives.tree("tenant-a", record.ref()).joinpath("task").write_bytes(b"t")
    archives.save(record, b"tar")
    folder = tmp_path / "archives" / "tenant-a"
    held = archives.held_bytes("tenant-a")
    archives.tree("tenant-a", "big@1").joinpath("blob").write_bytes(b"x" * 5_000)  # killed before its record
    write_atomically(folder / "big@1.tar", b"y" * 5_000)
    (folder / ".tmp-abc").write_bytes(b"z" * 1_000)
    (folder / ".staging-def").mkdir()
    assert archives.held_bytes("tenant-a") == held + 10_000
    assert archives.sweep() == 4
    assert archives.held_bytes("tenant-a") == held and archives.load_all() == [record]
    assert sorted(p.name for p in folder.iterdir()) == ["a@1.tar", "a@1.tar.json", "a@1.tar.tar"]
