"""The result log on disk: a worker's rollout kept in both forms as it came and streamed from its wire bytes; a log
written before that column opens and streams as before; calls batched into one transaction still fail alone; calls
that many callers make one by one while the store is busy share a transaction, and one caller's calls in a row never
wait for company."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

import pytest

from orchestrator.core.models import EncodedRollout, JobSpec, Rollout, RolloutStatus, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.server.app import OrchestratorConfig
from orchestrator.server.convert import batch_to_pb, entry_to_pb, rollout_pb
from orchestrator.service import store as store_module
from orchestrator.service.jobs import Batch
from orchestrator.service.store import LogEntry, ResultStore
from orchestrator.testing.synthetic_rollouts import long_rollout
from orchestrator.worker import release


def _encoded(r: Rollout) -> EncodedRollout:
    js = r.model_dump_json(exclude={"seq"})
    wire = rollout_pb(js).SerializeToString()
    return EncodedRollout(r.id, r.job_id, r.group_id, r.status, r.reward, r.attempts, js, wire)


def _sample(i: int, job: str = "job-a") -> Rollout:
    return long_rollout(turns=6, job_id=job).model_copy(
        update={"id": f"{job}:task-{i}:0", "task_id": f"task-{i}", "group_id": f"{job}:task-{i}"}
    )


async def _published_groups(store: ResultStore, groups: int, size: int, first: int = 0) -> list[LogEntry]:
    """`groups` whole groups of `size` samples of job-a (tasks from `first` on), appended and published: the entries
    a stream reads."""
    for task in range(first, first + groups):
        for k in range(size):
            r = _sample(task).model_copy(update={"id": f"job-a:task-{task}:{k}", "sample_index": k})
            await store.append(_encoded(r), visible=False)
    assert await store.publish_complete_groups("job-a", size) == groups
    return await store.read("job-a", 0, 10_000)


async def test_a_workers_rollout_is_streamed_from_its_wire_bytes(tmp_path: Path) -> None:
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    try:
        r = _sample(0)
        enc = _encoded(r)
        seq = await store.append(enc)
        assert seq is not None
        assert await store.append(enc) is None  # idempotent by id, as a model's append
        (entry,) = await store.read("job-a", 0, 10)
        assert entry.wire == enc.wire and entry.payload == enc.json
        m = entry_to_pb(entry)
        assert m.seq == seq and m.id == r.id and list(m.tokens.completion_ids) == r.tokens.completion_ids
        assert entry.rollout() == r.model_copy(update={"seq": seq})  # the log's JSON is the truth, exact
        (streamed,) = batch_to_pb(Batch(entries=[entry])).rollouts
        assert streamed == m
    finally:
        await store.close()


async def test_whole_groups_keep_their_wire_bytes_when_published(tmp_path: Path) -> None:
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    try:
        members = [_sample(0).model_copy(update={"id": f"job-a:task-0:{k}", "sample_index": k}) for k in range(2)]
        for m in members:
            await store.append(_encoded(m), visible=False)
        assert await store.publish_complete_groups("job-a", 2) == 1
        entries = await store.read("job-a", 0, 10)
        assert [e.wire for e in entries] == [_encoded(m).wire for m in members]
    finally:
        await store.close()


async def test_an_ack_up_to_inside_a_group_acks_the_whole_group(tmp_path: Path) -> None:
    # a trainer (in any language) that acks the last seq it processed, inside a group: the group's rest went out
    # again as a part group, with advantages made over the part
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    try:
        seqs = [e.seq for e in await _published_groups(store, 2, 4)]
        # a group is acked whole or not at all: an up_to inside one acks none of it, sent whole or not (acked whole,
        # its parts on the wire or not sent yet were lost with a broken stream)
        assert await store.ack("job-a", seqs[1], [], delivered=seqs[-1], whole_groups=True) == []
        assert [e.seq for e in await store.read("job-a", 0, 10)] == seqs  # both groups, whole
        assert await store.ack("job-a", seqs[5], [], delivered=seqs[-1], whole_groups=True) == seqs[:4]
        # by id: a group whose parts are not all sent is not acked; once they are, an id acks its group whole
        assert await store.ack("job-a", 0, ["job-a:task-1:0"], delivered=seqs[5], whole_groups=True) == []
        assert [e.seq for e in await store.read("job-a", 0, 10)] == seqs[4:]
        assert await store.ack("job-a", 0, ["job-a:task-1:0"], delivered=seqs[7], whole_groups=True) == seqs[4:]
        more = [e.seq for e in await _published_groups(store, 1, 4, first=2)]
        assert await store.ack("job-a", more[1], [], delivered=more[-1]) == more[:2]
    finally:
        await store.close()


async def test_an_ack_that_cuts_a_group_finds_the_group_on_the_index(tmp_path: Path) -> None:
    # the cut group was found by sorting every row of the job (40 ms an Ack at 200,000 rows) on the one thread that
    # every tenant's appends, reads and acks share: a trainer acking every 100 ms near the end of a large job, or a
    # tenant acking on purpose, held up the whole fleet's delivery
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    try:
        seqs = [e.seq for e in await _published_groups(store, 3, 2)]
        await store.ack("job-a", seqs[1], [], delivered=seqs[-1], whole_groups=True)  # the first group
        query = f"EXPLAIN QUERY PLAN {store_module.CUT_GROUP_REST}"
        plan = " ".join(row[-1] for row in store.db.execute(query, ("job-a", 0, "job-a", 0)))
        assert "TEMP B-TREE" not in plan and "acked=? AND seq<?" in plan, plan
        # an up_to in the acked group, then in the next: only the unacked group is cut, and acked not at all until
        # an up_to reaches its last rollout
        assert await store.ack("job-a", seqs[0], [], delivered=seqs[-1], whole_groups=True) == []
        assert await store.ack("job-a", seqs[2], [], delivered=seqs[-1], whole_groups=True) == []
        assert await store.ack("job-a", seqs[3], [], delivered=seqs[-1], whole_groups=True) == seqs[2:4]
    finally:
        await store.close()


def _reads_the_backlog(plan: str) -> bool:
    """Whether a query plan walks the job's index with no seq bound (every visible or unacked row of the job)."""
    return "SCAN rollouts" in plan or ("rollouts_job_seq" in plan and "seq" not in plan.split("rollouts_job_seq")[1])


async def test_acks_and_group_checks_read_their_own_rows_not_the_jobs_backlog(tmp_path: Path) -> None:
    # planned on the job's index, an Ack's cut group read every unacked row of the job past up_to (72 ms at 100,000
    # behind), an Ack by ids every unacked row up to `delivered` once per 500 ids (0.37 s for 5,000 ids), and a
    # grouped job's publish check, at each append, every hidden row of the job (0.9 ms an append with 64 groups of 64
    # in flight); all on the one thread every tenant's appends, reads and acks share
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    try:
        entries = await _published_groups(store, 40, 4)  # 160 delivered, unacked
        seqs = [e.seq for e in entries]
        for task in range(100, 110):  # groups in flight, hidden
            for k in range(3):
                r = _sample(task).model_copy(update={"id": f"job-a:task-{task}:{k}", "sample_index": k})
                await store.append(_encoded(r), visible=False)
        statements: list[str] = []
        store.db.set_trace_callback(statements.append)
        try:
            await store.ack("job-a", seqs[1], [], delivered=seqs[-1], whole_groups=True)  # cuts the first group
            await store.ack("job-a", 0, ["job-a:task-5:0"], delivered=seqs[-1])
            await store.ack("job-a", 0, ["job-a:task-9:1"], delivered=seqs[-1], whole_groups=True)
            assert await store.publish_complete_groups("job-a", 4, "job-a:task-100") == 0
        finally:
            store.db.set_trace_callback(None)
        selects = [q for q in statements if q.lstrip().upper().startswith("SELECT")]
        plans = {q: " | ".join(row[-1] for row in store.db.execute(f"EXPLAIN QUERY PLAN {q}")) for q in selects}
        assert len(plans) >= 5, plans
        backlog = {q: plan for q, plan in plans.items() if _reads_the_backlog(plan)}
        assert not backlog, backlog
        # and what they acked: none of the cut group, the one id, and the other id's group
        acked = {"job-a:task-5:0", "job-a:task-9"}
        left = [e.seq for e in entries if e.group_id not in acked and e.rollout_id not in acked]
        assert [e.seq for e in await store.read("job-a", 0, 1000)] == left and len(left) == 160 - 5
    finally:
        await store.close()


async def test_a_log_from_before_the_group_index_held_visible_gets_it(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite3"
    store = await ResultStore.open(path)
    try:
        await _published_groups(store, 2, 2)
        await store._run(lambda: store.db.execute("DROP INDEX rollouts_group_visible"))
        await store._run(lambda: store.db.execute("CREATE INDEX rollouts_group ON rollouts (job_id, group_id)"))
    finally:
        await store.close()
    store = await ResultStore.open(path)
    try:
        names = {r[0] for r in store.db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert "rollouts_group_visible" in names and "rollouts_group" not in names, names
        assert len(await store.read("job-a", 0, 10)) == 4
    finally:
        await store.close()


async def test_an_ack_inside_a_group_in_parts_leaves_the_group_whole(tmp_path: Path) -> None:
    # a group over a message goes out in parts, so what was delivered can end inside it. An up_to or an id there
    # acked the parts sent only, and the rest went out again as a shorter group, its advantages made over the rest;
    # then it acked the parts not sent yet too, which were never sent. Now it acks none of the group: the rest goes
    # out as it would have, and a stream that breaks sends the group again whole
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    try:
        seqs = [e.seq for e in await _published_groups(store, 2, 4)]
        assert await store.ack("job-a", seqs[1], [], delivered=seqs[1], whole_groups=True) == []
        assert await store.ack("job-a", 0, ["job-a:task-0:0"], delivered=seqs[1], whole_groups=True) == []
        assert [e.seq for e in await store.read("job-a", 0, 10)] == seqs
        # every part sent (or on the wire): still none of it by an up_to inside it
        assert await store.ack("job-a", seqs[1], [], delivered=seqs[3], whole_groups=True) == []
        assert await store.ack("job-a", seqs[3], [], delivered=seqs[3], whole_groups=True) == seqs[:4]
        assert await store.ack("job-a", 0, ["job-a:task-1:0"], delivered=seqs[7], whole_groups=True) == seqs[4:]
        assert await store.read("job-a", 0, 10) == []
    finally:
        await store.close()


async def test_a_read_stops_where_its_bytes_run_out(tmp_path: Path) -> None:
    # a stream asks for up to 10,000 rows and sends 3 MiB of them: read whole and cut after, a backlog of large
    # rows was read (and held, on the log's one thread) over and over, 2 GB for each message
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    try:
        everything = await _published_groups(store, 4, 3)
        sizes = [len(e.wire or b"") for e in everything]
        assert len(everything) == 12 and all(sizes)
        budget = sum(sizes[:4]) + sizes[4] // 2  # crossed by the fifth row, in the second group
        assert [e.seq for e in await store.read("job-a", 0, 10_000, budget)] == [e.seq for e in everything[:5]]
        # a group is no exception: a stream sends one over its bytes in parts (jobs._grouped_message)
        assert [e.seq for e in await store.read("job-a", 0, 10_000, 1)] == [everything[0].seq]
        assert len(await store.read("job-a", 0, 2, budget)) == 2  # and the row limit holds
    finally:
        await store.close()


OLD_SCHEMA = """
CREATE TABLE jobs (job_id TEXT PRIMARY KEY, spec TEXT NOT NULL, state TEXT NOT NULL, created_at REAL NOT NULL,
    finished_at REAL, total INTEGER NOT NULL, owner TEXT NOT NULL DEFAULT 'local');
CREATE TABLE rollouts (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, rollout_id TEXT NOT NULL UNIQUE,
    group_id TEXT NOT NULL, status TEXT NOT NULL, payload TEXT NOT NULL, acked INTEGER NOT NULL DEFAULT 0,
    visible INTEGER NOT NULL DEFAULT 1);
"""


async def test_a_log_from_before_wire_bytes_opens_and_streams(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    r = _sample(1)
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute(
        "INSERT INTO rollouts (job_id, rollout_id, group_id, status, payload) VALUES (?, ?, ?, ?, ?)",
        (r.job_id, r.id, r.group_id, r.status.value, r.model_dump_json(exclude={"seq"})),
    )
    db.commit()
    db.close()
    store = await ResultStore.open(path)
    try:
        (entry,) = await store.read(r.job_id, 0, 10)
        assert entry.wire is None
        assert entry_to_pb(entry) == rollout_pb(entry.payload, entry.seq)  # converted from its JSON, as before
        seq = await store.append(_encoded(_sample(2)))  # and new rows carry their bytes
        assert seq is not None and (await store.read(r.job_id, entry.seq, 10))[0].wire
        assert store.db.execute("PRAGMA page_size").fetchone()[0] == 4096  # it keeps the pages it was made with
    finally:
        await store.close()


async def test_a_new_log_has_pages_of_several_rollouts(tmp_path: Path) -> None:
    """A rollout's row (JSON and wire form) is about 3 KB: on the default 4 KB pages its insert and its ack each wrote
    nearly a page of its own."""
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    try:
        assert store.db.execute("PRAGMA page_size").fetchone()[0] == store_module.PAGE_SIZE == 16384
        assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        enc = _encoded(_sample(0))
        assert len(enc.json) + len(enc.wire) > 2500
        for i in range(10):
            await store.append(_encoded(_sample(i)))
        assert [e.seq for e in await store.read("job-a", 0, 100)] == list(range(1, 11))
    finally:
        await store.close()


async def test_a_call_that_fails_in_a_batch_fails_alone(tmp_path: Path) -> None:
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    spec = JobSpec(
        env="python-tool", tasks=TaskSelection(kind="ids", ids=["py-001"]), policy=PolicyEndpoint(base_url=REPLAY_URL)
    )
    try:
        await store.create_job("job-1", spec, 1)
        # issued in one turn of the loop: one transaction; the duplicate job id fails inside it
        first, dup, last = await asyncio.gather(
            store.append(_encoded(_sample(0, "job-1"))),
            store.create_job("job-1", spec, 1),
            store.append(_sample(1, "job-1")),
            return_exceptions=True,
        )
        assert isinstance(dup, sqlite3.IntegrityError), dup
        assert isinstance(first, int) and isinstance(last, int)
        assert [e.rollout().id for e in await store.read("job-1", 0, 10)] == ["job-1:task-0:0", "job-1:task-1:0"]
        assert len(await store.jobs()) == 1
    finally:
        await store.close()


def _spec() -> JobSpec:
    return JobSpec(
        env="python-tool", tasks=TaskSelection(kind="ids", ids=["py-001"]), policy=PolicyEndpoint(base_url=REPLAY_URL)
    )


@contextlib.asynccontextmanager
async def _paced_store(path: Path) -> AsyncIterator[tuple[ResultStore, list[int]]]:
    """A store on `path`, with the size of every transaction it runs (COMMIT_GAP_S as the caller set it); closed
    afterwards."""
    store = await ResultStore.open(path)
    sizes: list[int] = []
    run = store._transaction

    def counted(calls: list[Callable[[], Any]]) -> list[tuple[bool, Any]]:
        sizes.append(len(calls))
        return run(calls)

    store._transaction = counted  # type: ignore[method-assign]
    try:
        yield store, sizes
    finally:
        await store.close()


async def test_calls_of_many_callers_arriving_one_by_one_share_a_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a gap far above any scheduling noise: what arrives within it after a transaction joins the next one
    monkeypatch.setattr(store_module, "COMMIT_GAP_S", 0.5)
    async with _paced_store(tmp_path / "log.sqlite3") as (store, sizes):
        await store.create_job("job-0", _spec(), 1)  # the first call after a quiet spell runs at once, alone

        async def submit(i: int) -> None:
            await asyncio.sleep(0.01 * i)  # one by one, as gRPC hands a burst of calls to the loop
            await store.create_job(f"job-{i}", _spec(), 1)

        await asyncio.gather(*(submit(i) for i in range(1, 6)))
        assert sizes == [1, 5]
        assert len(await store.jobs()) == 6


async def test_one_callers_calls_in_a_row_do_not_wait_for_company(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # were the next call of the caller just served paced, these 20 calls would take 20 minutes
    monkeypatch.setattr(store_module, "COMMIT_GAP_S", 60.0)
    async with _paced_store(tmp_path / "log.sqlite3") as (store, sizes):
        async with asyncio.timeout(30):
            for i in range(10):
                await store.create_job(f"job-{i}", _spec(), 1)
                assert (await store.counts(f"job-{i}")) == ({}, 0)
        assert sizes == [1] * 20


@pytest.mark.parametrize("status", [RolloutStatus.INFRA_ERROR, RolloutStatus.TIMEOUT])
async def test_a_failed_rollout_is_stored_without_a_reward(tmp_path: Path, status: RolloutStatus) -> None:
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    try:
        r = _sample(3).model_copy(update={"status": status, "reward": None})
        await store.append(_encoded(r))
        (entry,) = await store.read(r.job_id, 0, 10)
        m = entry_to_pb(entry)
        assert not m.HasField("reward") and entry.rollout().reward is None
    finally:
        await store.close()


async def test_the_log_is_synced_to_disk_at_each_commit_unless_the_operator_trades_that_for_speed(
    tmp_path: Path,
) -> None:
    # WAL with synchronous=NORMAL kept a commit through a crash of the process, not of the host: a power loss took
    # the last rollouts back, which a trainer may have read and acked; their reruns came under new seqs, past its
    # dedup, and its cursor, past the log's end now, was refused
    modes: list[tuple[Literal["full", "normal"], int]] = [("full", 2), ("normal", 1)]
    for sync, level in modes:
        store = await ResultStore.open(tmp_path / f"{sync}.sqlite3", synchronous=sync)
        try:
            assert store.db.execute("PRAGMA synchronous").fetchone()[0] == level
        finally:
            await store.close()
    store = await ResultStore.open(tmp_path / "default.sqlite3")
    try:
        assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2
    finally:
        await store.close()
    assert OrchestratorConfig().result_log_sync == "full"


async def test_the_write_ahead_log_is_cut_back_after_a_large_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the WAL kept the size of the largest transaction for good: a group of 1,024 samples of 8 MiB published in one
    # was 8 GiB of the host's disk while the rows it carried were long in the log itself
    monkeypatch.setattr(store_module, "WAL_LIMIT_BYTES", 1 << 20)
    store = await ResultStore.open(tmp_path / "log.sqlite3")
    wal = tmp_path / "log.sqlite3-wal"
    try:
        big = long_rollout(turns=2, tool_output="x" * 400_000)
        for k in range(60):  # 24 MB in one publish
            r = big.model_copy(update={"id": f"{big.job_id}:task-0:{k}", "sample_index": k})
            await store.append(_encoded(r), visible=False)
        assert await store.publish_complete_groups(big.job_id, 60) == 1
        peak = wal.stat().st_size
        for i in range(3):  # later small writes: the checkpointed log starts over, cut back to the limit
            await store.append(_encoded(_sample(i, job="job-b")))
        assert peak > 16 << 20 and wal.stat().st_size <= 2 << 20, (peak, wal.stat().st_size)
    finally:
        await store.close()


async def test_a_log_stamped_by_a_newer_envfleet_is_refused(tmp_path: Path) -> None:
    # a downgrade read a newer log with what it knew: its jobs lost the policy column UpdatePolicy writes (their
    # endpoint went back to the submitted one), and again after the upgrade back
    import sqlite3

    from orchestrator.core.errors import ConfigError

    path = tmp_path / "log.sqlite3"
    store = await ResultStore.open(path)
    await store.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == store_module.LOG_VERSION  # stamped
    db.execute(f"PRAGMA user_version = {store_module.LOG_VERSION + 1}")
    db.close()
    with pytest.raises(ConfigError, match="written by a newer envfleet"):
        await ResultStore.open(path)


@pytest.mark.parametrize("acked", ["keep", "slim"])
async def test_a_slim_log_drops_an_acked_rollouts_episode_and_keeps_its_record(
    tmp_path: Path, acked: Literal["keep", "slim"]
) -> None:
    # an acked rollout stayed whole until its job's retention ran out: a job of weeks kept every episode it ever
    # delivered (100-600 KB a rollout with token ids and logprobs, in two forms). Slim, the ack drops the episode
    store = await ResultStore.open(tmp_path / "log.sqlite3", acked=acked)
    try:
        first, second = _sample(0), _sample(1)
        seqs = [await store.append(_encoded(r)) for r in (first, second)]
        assert seqs[0] is not None and await store.ack("job-a", seqs[0], [], delivered=seqs[-1] or 0) == [seqs[0]]
        rows = store.db.execute("SELECT payload, wire FROM rollouts ORDER BY seq").fetchall()
        kept = Rollout.model_validate_json(rows[0][0])
        assert (kept.id, kept.status, kept.reward, kept.metrics, kept.timing) == (
            first.id, first.status, first.reward, first.metrics, first.timing
        )  # fmt: skip
        if acked == "slim":
            assert kept.turns == [] and rows[0][1] is None and len(rows[0][0]) < len(rows[1][0]) / 4
        else:
            assert kept.turns == first.turns and rows[0][1] is not None
        (unacked,) = await store.read("job-a", 0, 10)  # what a stream reads is whole either way
        assert Rollout.model_validate_json(unacked.payload).turns == second.turns and unacked.wire
        assert (await store.counts("job-a")) == ({first.status.value: 2}, 1)
        # a row whose JSON is damaged (a stream sends its wire bytes, unread) is acked all the same: SQLite's
        # json_remove refused it, and every ack that reached it failed, its rows sent again for ever
        store.db.execute("UPDATE rollouts SET payload = '{damaged' WHERE seq = ?", (seqs[1],))
        assert await store.ack("job-a", seqs[1] or 0, [], delivered=seqs[1] or 0) == [seqs[1]]
    finally:
        await store.close()
    assert OrchestratorConfig().result_log_acked == "keep"
    from orchestrator.cli.main import _server_config, build_parser

    config = _server_config(build_parser().parse_args(["serve", "--result-log-acked", acked]))
    assert isinstance(config, OrchestratorConfig) and config.result_log_acked == acked


# the shape of the models the log's rows hold, by layout (their JSON schemas without prose: fields, types,
# constraints, enum values, extra fields refused): a change to it without a new LOG_VERSION let an older envfleet
# read the log and drop each job whose spec it refused, where the stamp would have refused the log, naming the version
# 3: the same rows, and job_bytes; 4: PolicyEndpoint.outage_wait_s
STORED_SHAPES = {2: "419ff3e89392d1cd", 3: "419ff3e89392d1cd", 4: "d4efd94f8a8b2d85"}


def test_the_shape_of_what_the_log_stores_is_its_layouts() -> None:
    digest = hashlib.sha256()
    for model in (JobSpec, Rollout):
        digest.update(json.dumps(release._shape(model.model_json_schema(mode="validation")), sort_keys=True).encode())
    shape = digest.hexdigest()[:16]
    assert STORED_SHAPES.get(store_module.LOG_VERSION) == shape, (
        f"the stored models changed (shape {shape}): bump store.LOG_VERSION and pin the new shape in STORED_SHAPES"
    )


async def test_a_jobs_bytes_are_kept_as_it_grows_and_counted_once_for_a_log_from_before(tmp_path: Path) -> None:
    # summed from the rows, the bytes a job held (caps.result_bytes_per_tenant) read every payload whole: a start
    # read the whole log, and a cancel held every tenant's calls behind its job's rows
    path = tmp_path / "log.sqlite3"
    spec = JobSpec(env="e", tasks=TaskSelection(kind="ids", ids=["t"]), policy=PolicyEndpoint(base_url=REPLAY_URL))
    store = await ResultStore.open(path)
    try:
        await store.create_job("job-a", spec, 4)

        async def refused() -> None:
            await store._run(lambda: store.db.execute("INSERT INTO nowhere VALUES (1)"))

        # a batch with a call that fails: run again call by call, the others counted once, the failed one not
        calls = [store.append_sized(_encoded(_sample(i))) for i in range(3)]
        *appended, failed = await asyncio.gather(*calls, refused(), return_exceptions=True)
        assert isinstance(failed, sqlite3.OperationalError)
        sizes = [a[1] for a in appended if isinstance(a, tuple)]
        assert len(sizes) == 3 and await store.append_sized(_encoded(_sample(0))) is None  # a duplicate adds nothing
        summed = await store._run(
            lambda: store.db.execute(f"SELECT {store_module.STORED_BYTES} FROM rollouts").fetchone()[0]
        )
        assert await store.stored_bytes("job-a") == sum(sizes) == summed

        # the count is one row's read, not the rollouts' (the statements it ran say so)
        traced: list[str] = []
        await store._run(lambda: store.db.set_trace_callback(traced.append))
        assert await store.stored_bytes("job-a") == summed
        await store._run(lambda: store.db.set_trace_callback(None))
        assert not [t for t in traced if "FROM rollouts" in t], traced
        # a log from before the table: counted from its rows once, then kept
        await store._run(lambda: store.db.execute("DELETE FROM job_bytes"))
    finally:
        await store.close()
    store = await ResultStore.open(path)
    try:
        assert await store.stored_bytes("job-a") == summed
        await store.append_sized(_encoded(_sample(3)))
        assert await store.stored_bytes("job-a") > summed
        await store.remove_job("job-a")
        assert await store._run(lambda: store.db.execute("SELECT COUNT(*) FROM job_bytes").fetchone()[0]) == 0
    finally:
        await store.close()
