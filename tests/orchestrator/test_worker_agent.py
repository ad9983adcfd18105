"""The worker process's side of the wire against a control plane of the test's own (a real gRPC server on a unix
socket, scripted): what a worker leaves behind when streams end, and a result too large to send."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from pydantic import ValidationError

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.core.models import Rollout, Turn
from orchestrator.rollout.runner import WorkItem
from orchestrator.service.registry import Registry
from orchestrator.worker.agent import WorkerAgent
from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.outbox import Outbox
from orchestrator.worker.results import MAX_ROLLOUT_BYTES
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tests.conftest import TEST_OWNER
from tests.orchestrator.worker_wire import ENV, TOKEN, rollout_for, spec


class _Executor:
    """Runs nothing: sample 0 answers at once (`big`: with a rollout past the wire's cap), sample 1 runs until
    cancelled."""

    def __init__(self, big: bool = False) -> None:
        self.big = big
        self.cancelled: list[int] = []
        self.ended: list[str] = []
        self.retries: list[int] = []  # each run's job spec's max_infra_retries

    async def run(self, item: WorkItem, env: Any, job: Any) -> Rollout:
        self.retries.append(job.max_infra_retries)
        if item.sample_index == 1:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.append(item.sample_index)
                raise
        a = wpb.Assignment(job_id=item.job_id, task_id=item.task.id, sample_index=item.sample_index)
        turns = [Turn(role="tool", text="x" * (MAX_ROLLOUT_BYTES + 1))] if self.big else []
        return rollout_for(a, turns=turns)

    def job_ended(self, job_id: str) -> None:
        self.ended.append(job_id)


class _ControlPlane(wpb_grpc.WorkerServiceServicer):  # type: ignore[misc]
    """Assigns `samples` of one job on the first stream (and ends it at its first results when `end_after_results`),
    then ends every later stream at once."""

    def __init__(
        self,
        task_id: str,
        samples: tuple[int, ...],
        *,
        end_after_results: bool,
        assignments: list[wpb.Assignment] | None = None,  # sent in place of the samples'
    ) -> None:
        self.task_id, self.samples, self.end_after_results = task_id, samples, end_after_results
        self.assignments = assignments
        self.streams = 0
        self.results: list[wpb.RolloutResult] = []

    async def Connect(self, inbound: AsyncIterator[wpb.WorkerMessage], context: Any) -> AsyncIterator[Any]:
        self.streams += 1
        await anext(aiter(inbound))  # the hello
        if self.streams > 1:
            return
        job = spec([self.task_id]).model_dump_json().encode()
        assignments = self.assignments or [
            wpb.Assignment(assignment_id=f"a{i}", job_spec_json=job, job_id="j", task_id=self.task_id, sample_index=i)
            for i in self.samples
        ]
        yield wpb.ControlMessage(assign=wpb.AssignmentBatch(assignments=assignments))
        async for m in inbound:
            if m.HasField("results"):
                self.results += m.results.results
                if self.end_after_results:
                    return


async def _agent_against(
    plane: _ControlPlane, executor: _Executor, tmp_path: Path, *, streams: int, results: int
) -> WorkerAgent:
    """A worker against `plane` until it has opened `streams` streams and `plane` has `results` results."""
    target = f"unix:{tmp_path}/w.sock"
    server = grpc.aio.server()
    wpb_grpc.add_WorkerServiceServicer_to_server(plane, server)
    server.add_insecure_port(target)
    await server.start()
    agent = WorkerAgent(target, TOKEN, executor, Registry.from_entry_points(), heartbeat_s=0.2)  # type: ignore[arg-type]
    stop = asyncio.Event()
    run = asyncio.create_task(agent.run_forever(stop))
    try:
        for _ in range(600):
            if plane.streams >= streams and len(plane.results) >= results:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # and a little longer: what it does next
    finally:
        stop.set()
        await asyncio.wait_for(run, 10)
        await server.stop(0)
    return agent


def _senders() -> int:
    return sum("_consume_request_iterator" in repr(t.get_coro()) for t in asyncio.all_tasks())


async def test_streams_that_end_leave_no_sender_and_no_job_behind(tmp_path: Path) -> None:
    # gRPC's sender of a stream the server ended waited on the worker's outbox for good (one task, its outbox and
    # call a reconnect); and a job that ended while the worker was away was never said to end to it, so its spec
    # and snapshots stayed for the life of the process
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    executor = _Executor()
    plane = _ControlPlane(task_id, (0,), end_after_results=True)
    agent = await _agent_against(plane, executor, tmp_path, streams=3, results=1)
    assert plane.streams >= 3 and agent.sessions >= 3  # it reconnected, each stream ended by the server
    assert [r.assignment_id for r in plane.results] == ["a0"]
    await asyncio.sleep(0.1)
    gc.collect()
    assert _senders() == 0
    assert sum(isinstance(o, Outbox) for o in gc.get_objects()) == 0
    assert executor.ended == ["j"] and not agent._specs


async def test_a_worker_runs_assignments_without_a_spec_on_the_spec_its_job_carried_last(tmp_path: Path) -> None:
    # a job's spec (and a declarative environment's, up to 100,000 tasks) went with each of its assignments; a worker
    # that says it keeps specs gets them once a stream, and one that never came is an error, not a default spec
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    job = spec([task_id]).model_dump_json().encode()
    sent = [
        wpb.Assignment(assignment_id="carries", job_spec_json=job, job_id="j", task_id=task_id, sample_index=0),
        wpb.Assignment(assignment_id="kept", job_id="j", task_id=task_id, sample_index=2),
        wpb.Assignment(assignment_id="never-sent", job_id="other", task_id=task_id, sample_index=3),
    ]
    plane = _ControlPlane(task_id, (), end_after_results=False, assignments=sent)
    agent = await _agent_against(plane, _Executor(), tmp_path, streams=1, results=3)
    got = {r.assignment_id: r for r in plane.results}
    assert got["carries"].rollout_pb and got["kept"].rollout_pb and not got["kept"].error
    assert "no spec of job other came on this stream" in got["never-sent"].error
    assert not got["never-sent"].rollout_pb
    assert not agent._carried and not agent._job_envs  # the stream's end drops what it carried


async def test_a_result_too_large_to_send_fails_alone_and_the_stream_goes_on(tmp_path: Path) -> None:
    # past the wire's message cap the send failed the whole stream: every other rollout on the worker was cancelled,
    # its sandbox destroyed, and the rollout, retried elsewhere, did the same to the next worker
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    executor = _Executor(big=True)
    plane = _ControlPlane(task_id, (0, 1), end_after_results=False)
    await _agent_against(plane, executor, tmp_path, streams=1, results=1)
    assert plane.streams == 1, "the stream ended"
    [result] = plane.results
    assert result.assignment_id == "a0" and "over" in result.error and not result.rollout_pb
    assert executor.cancelled == [1]  # only by the worker's own stop, at the end


async def test_a_worker_whose_start_fails_midway_closes_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the backend, the pool and their tasks were made before the parts that can fail (a module a Ray node lacks, the
    # agent): a failed start left them running for as long as the process lived, and a Ray actor's slot was placed
    # again at every poll, each new one sweeping the engine and warming sandboxes before it failed the same way
    from orchestrator.worker import process

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the agent could not be made")

    monkeypatch.setattr(process, "WorkerAgent", broken)
    before = asyncio.all_tasks()
    config = WorkerConfig(backend=FakeBackendConfig(owner=TEST_OWNER))
    with pytest.raises(RuntimeError, match="could not be made"):
        await process.run_worker(f"unix:{tmp_path}/nobody.sock", "token", config, "w", asyncio.Event())
    await asyncio.sleep(0.1)
    left = [t for t in asyncio.all_tasks() - before if not t.done()]
    assert left == [], left


def _carrying(m: wpb.ArchiveEnvironment, data: bytes) -> wpb.ArchiveEnvironment:
    """`m` as an assignment that carries the archive's bytes sends it: with `data` as those bytes."""
    out = wpb.ArchiveEnvironment()
    out.CopyFrom(m)
    out.archive = data
    return out


def _archive_agent(tmp_path: Path, kind: object) -> WorkerAgent:
    """A worker agent (connected to nothing) with `kind` as the plug-in of archives of kind "k"."""
    return WorkerAgent(
        f"unix:{tmp_path}/w.sock",
        TOKEN,
        _Executor(),  # type: ignore[arg-type]
        Registry.from_entry_points(),
        kinds={"k": kind},  # type: ignore[dict-item]
    )


async def test_an_archive_that_failed_to_load_loads_when_its_bytes_come_again(tmp_path: Path) -> None:
    # a failed load stayed the answer for the worker's life: a passing fault (a full disk, bytes damaged on the way)
    # broke the uploaded environment on this worker for good, since the control plane sends the bytes once a stream
    import hashlib
    import shutil

    loaded: list[bytes] = []

    class Kind:
        rules = ""

        def load(self, archive: Path, tree: Path, name: str, version: str, limits: Any) -> str:
            loaded.append(archive.read_bytes())
            return f"{name}@{version}"

        def validated(self, env: Any) -> Any:
            return env

    good = b"the archive"
    sent = wpb.ArchiveEnvironment(kind="k", name="env", version="1", sha256=hashlib.sha256(good).hexdigest())
    agent = _archive_agent(tmp_path, Kind())
    try:
        agent._start_loading(_carrying(sent, b"the archivE"))  # damaged on the way
        with pytest.raises(ValueError, match="arrived damaged"):
            await agent._archived(sent)
        again = _carrying(sent, good)
        agent._start_loading(again)
        assert cast(str, await agent._archived(sent)) == "env@1" and loaded == [good]
        agent._start_loading(again)  # a load that worked is kept
        assert cast(str, await agent._archived(sent)) == "env@1" and loaded == [good]
    finally:
        if agent._archive_dir is not None:
            shutil.rmtree(await agent._archives_folder(), True)


async def test_two_registrations_of_the_same_bytes_are_two_environments_on_a_worker(tmp_path: Path) -> None:
    # a worker kept uploaded environments by the archive's digest: another tenant's registration of the same bytes
    # (or another version, or one validated under older rules) ran as the first, with its name and its validation
    import hashlib
    import shutil

    class Kind:
        rules = "2"  # this worker's plug-in's: the second registration was validated under older ones

        def load(self, archive: Path, tree: Path, name: str, version: str, limits: Any) -> str:
            return f"{name}@{version}:{archive.read_bytes().decode()}"

        def validated(self, env: Any) -> Any:
            return env + " (validated)"

    data = b"tasks"
    first = wpb.ArchiveEnvironment(
        kind="k", name="a", version="1", sha256=hashlib.sha256(data).hexdigest(), archive=data, rules="2"
    )
    # the control plane sends a stream a digest's bytes once: the second registration's assignment has none
    second = wpb.ArchiveEnvironment(kind="k", name="b", version="2", sha256=first.sha256, rules="1")
    agent = _archive_agent(tmp_path, Kind())
    try:
        agent._start_loading(first)
        assert cast(str, await agent._archived(second)) == "b@2:tasks"
        assert cast(str, await agent._archived(first)) == "a@1:tasks (validated)"
        unknown = wpb.ArchiveEnvironment(kind="k", name="c", version="1", sha256="0" * 64)
        with pytest.raises(LookupError, match="sent no archive of c@1"):
            await agent._archived(unknown)
        # a registration whose load failed loads again when the bytes come again, whichever registration's
        # assignment carries them (the control plane sends them once after a failure)
        other = b"other tasks"
        digest = hashlib.sha256(other).hexdigest()
        c = wpb.ArchiveEnvironment(kind="k", name="c", version="1", sha256=digest, archive=b"damaged", rules="2")
        d = wpb.ArchiveEnvironment(kind="k", name="d", version="1", sha256=digest, rules="2")
        agent._start_loading(c)  # and, in the same batch, another archive: one folder for both
        agent._start_loading(
            wpb.ArchiveEnvironment(
                kind="k", name="e", version="1", sha256=hashlib.sha256(b"e").hexdigest(), archive=b"e"
            )
        )
        with pytest.raises(ValueError, match="arrived damaged"):
            await agent._archived(d)
        agent._start_loading(_carrying(c, other))
        assert cast(str, await agent._archived(d)) == "d@1:other tasks (validated)"
        assert cast(str, await agent._archived(c)) == "c@1:other tasks (validated)"
        folder = await agent._archives_folder()
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == sorted(
            [first.sha256, digest, hashlib.sha256(b"e").hexdigest()]
        )
    finally:
        if agent._archive_dir is not None:
            shutil.rmtree(await agent._archives_folder(), True)


def test_one_name_at_version_of_other_content_is_another_environment_on_a_worker() -> None:
    # a worker kept declarative environments and their tasks by name@version: a control plane that came back with
    # another registration of that name and version (another data dir) had its rollouts run with the old tasks and
    # scored by the old command
    from orchestrator.service.declarative import parse_spec

    agent = WorkerAgent("unix:/nonexistent", TOKEN, cast(Any, None), Registry.from_entry_points())

    def spec_json(prompt: str, command: str) -> bytes:
        raw = {
            "name": "mine",
            "version": "1",
            "tools": ["submit"],
            "tasks": [{"id": "t1", "prompt": prompt}],
            "scoring": {"command": command},
        }
        return parse_spec(raw).model_dump_json().encode()

    first = agent._environment("mine@1", spec_json("old", "echo '{\"reward\": 0}'"))
    assert agent._task(first, "t1").prompt == "old"
    second = agent._environment("mine@1", spec_json("new", "echo '{\"reward\": 1}'"))
    assert second is not first and agent._task(second, "t1").prompt == "new"
    assert agent._environment("mine@1", spec_json("old", "echo '{\"reward\": 0}'")) is first
    # every version a worker ever ran stayed parsed: a trainer registering one a step grew each worker without end
    from orchestrator.worker.agent import MAX_DECLARATIVE

    for i in range(MAX_DECLARATIVE + 5):
        agent._environment("mine@1", spec_json(f"version {i}", "true"))
    assert len(agent._declarative) == MAX_DECLARATIVE
    assert agent._environment("mine@1", spec_json("old", "echo '{\"reward\": 0}'")) is not first  # parsed again


class _Refusing(wpb_grpc.WorkerServiceServicer):  # type: ignore[misc]
    """A control plane that refuses every worker's stream, as one does a worker whose token was rotated."""

    def __init__(self) -> None:
        self.streams = 0

    async def Connect(self, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.ControlMessage]:
        self.streams += 1
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid worker token")
        yield wpb.ControlMessage()  # never reached: makes this a generator, as a stream's handler is


async def test_a_refusal_no_retry_mends_is_logged_as_an_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # logged at info, under the default level, a worker whose token was rotated retried every 5 s unseen
    target = f"unix:{tmp_path}/w.sock"
    server = grpc.aio.server()
    plane = _Refusing()
    wpb_grpc.add_WorkerServiceServicer_to_server(plane, server)
    server.add_insecure_port(target)
    await server.start()
    agent = WorkerAgent(target, TOKEN, cast(Any, _Executor()), Registry.from_entry_points())
    stop = asyncio.Event()
    with caplog.at_level("WARNING", logger="orchestrator.worker.agent"):
        run = asyncio.create_task(agent.run_forever(stop))
        try:
            for _ in range(100):
                if plane.streams:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
        finally:
            stop.set()
            await asyncio.wait_for(run, 10)
            await server.stop(0)
    assert any(r.levelname == "ERROR" and "invalid worker token" in r.getMessage() for r in caplog.records)


async def test_a_worker_with_no_control_plane_for_its_orphan_time_ends(tmp_path: Path) -> None:
    # a detached Ray actor whose control plane never came back on its data directory redialed every 5 s for good
    agent = WorkerAgent(
        f"unix:{tmp_path}/nobody.sock", TOKEN, cast(Any, _Executor()), Registry.from_entry_points(), orphan_after_s=1
    )
    await asyncio.wait_for(agent.run_forever(asyncio.Event()), 10)
    assert agent.sessions >= 1


async def test_an_assignment_cancelled_before_it_ran_says_so() -> None:
    # a task cancelled before its first step never enters _run's handler, which answers a Cancel: the control plane
    # waited out the cancel's deadline (20 s) for each such assignment, holding its slot and the CancelJob
    import contextlib

    from orchestrator.worker.agent import _forget

    outbox: Outbox[wpb.WorkerMessage | wpb.RolloutResult] = Outbox()
    never = asyncio.ensure_future(asyncio.sleep(10))
    running, cancelled = {"a1": never, "a2": never}, {"a1"}
    never.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await never
    _forget(running, "a1", cancelled, outbox, never)
    _forget(running, "a2", cancelled, outbox, never)  # not cancelled by the control plane: nothing to say
    assert running == {} and cancelled == set()
    assert list(outbox._items) == [wpb.RolloutResult(assignment_id="a1", cancelled=True)]


async def test_a_worker_retries_within_what_lost_workers_left_of_the_jobs_budget(tmp_path: Path) -> None:
    # each worker's runner had the job's whole max_infra_retries, whatever attempts lost workers had spent
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    job = spec([task_id], max_infra_retries=3).model_dump_json().encode()
    assignments = [
        wpb.Assignment(
            assignment_id=f"a{spent}",
            job_spec_json=job,
            job_id="j",
            task_id=task_id,
            sample_index=0,
            attempts_spent=spent,
        )
        for spent in (0, 2)
    ]
    executor = _Executor()
    plane = _ControlPlane(task_id, (), end_after_results=False, assignments=assignments)
    await _agent_against(plane, executor, tmp_path, streams=1, results=2)
    assert sorted(executor.retries) == [1, 3]


async def test_a_worker_whose_plug_in_is_not_the_control_planes_refuses_its_rollouts(tmp_path: Path) -> None:
    # a worker resolved a plug-in environment by name@version from its own install: a node with another version of
    # it (other tasks, another reward function) ran and scored the rollouts as its own
    from orchestrator.core.environment import environment_digest

    env = Registry.from_entry_points().get(ENV)
    task_id = env.tasks()[0].id
    job = spec([task_id]).model_dump_json().encode()
    assignments = [
        wpb.Assignment(
            assignment_id=f"a{i}", job_spec_json=job, job_id="j", task_id=task_id, sample_index=0, env_digest=digest
        )
        for i, digest in enumerate((environment_digest(env), "0" * 64))
    ]
    plane = _ControlPlane(task_id, (), end_after_results=False, assignments=assignments)
    await _agent_against(plane, _Executor(), tmp_path, streams=1, results=2)
    by_id = {r.assignment_id: r for r in plane.results}
    assert by_id["a0"].rollout_json and not by_id["a0"].error
    assert not by_id["a1"].rollout_json and f"this worker's {ENV}@1 is not the control plane's" in by_id["a1"].error


def test_an_environments_digest_is_the_same_in_every_process_of_one_install(tmp_path: Path) -> None:
    # the digest a worker checks its install against: a reward function that was a functools.partial or a callable
    # object went in by its repr, an address other in every process, and every rollout was refused on every worker
    import os
    import subprocess
    import sys

    (tmp_path / "digest_env.py").write_text(
        "import functools\n"
        "from orchestrator.core.environment import Environment, Rubric, Task\n"
        "def match(ctx, key): return 1.0\n"
        "class Length:\n"
        "    def __call__(self, ctx): return 0.0\n"
        "class Env(Environment):\n"
        "    name = 'digest-env'\n"
        "    rubric = Rubric([('m', functools.partial(match, key='a'), 1.0), ('len', Length(), 0.0)])\n"
        "    def tasks(self):\n"
        "        return [Task(id=f't{i}', prompt='p', data={'set': {1, 2, 3}, (1, 2): 'tuple key', 3: 'int'})\n"
        "                for i in range(3)]\n"
    )
    probe = (
        "from digest_env import Env\nfrom orchestrator.core.environment import environment_digest\n"
        "print(environment_digest(Env()))"
    )

    def digest(seed: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": f"{tmp_path}:{os.getcwd()}"}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    first = digest("1")
    assert len(first) == 64 and digest("2") == first


def test_a_worker_host_the_control_plane_would_refuse_is_refused_in_its_configuration() -> None:
    """WorkerConfig.host goes in every hello, where a name of other characters, or longer, is refused
    (tests/security/test_worker_results.py): a worker configured so would redial for ever; it does not start."""
    assert WorkerConfig().host is None  # its machine's hostname, as before the field
    assert WorkerConfig(host="node-7.rack:2@a_b").host == "node-7.rack:2@a_b"
    assert WorkerConfig(host="h" * 256).host == "h" * 256  # the longest the hello check takes
    for bad in ("", "two words", "-leading", "h" * 257, "line\n"):
        with pytest.raises(ValidationError, match="host"):
            WorkerConfig(host=bad)
