"""The rollouts table's data: filters, orders (unscored last either way) and pages, at 100,000 rollouts; junk in
the query string falls back to defaults."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from orchestrator.service.store import ResultStore
from orchestrator.testing.synthetic_rollouts import long_rollout, many_rollouts
from orchestrator.viewer.index import MAX_PER_PAGE, Index, Query, Row
from orchestrator.viewer.sources import read_rows

N = 100_000


def _index() -> Index:
    # rows built directly (the fields many_rollouts gives, without 100,000 pydantic models): the index is under test
    rng = random.Random(0)
    statuses = ["OK"] * 6 + ["TRUNCATED", "TIMEOUT", "INFRA_ERROR"]
    index = Index()
    rows = []
    for i in range(N):
        status = rng.choice(statuses)
        task = f"task-{i // 4}"
        reward = rng.random() if status in ("OK", "TRUNCATED") else None
        env = rng.choice(["python-tool@1", "code-tests@1"])
        rows.append(
            Row(
                i + 1,
                f"j:{task}:{i % 4}",
                "j",
                env,
                task,
                f"job-many:{task}",
                i % 4,
                status,
                reward,
                3,
                rng.random(),
                i + 1,  # finished_at
            )
        )
    index.add(rows)
    return index


def test_filter_sort_and_page_100k_rollouts() -> None:
    index = _index()
    assert len(index.rows) == N and index.last_seq == N

    first = index.query(Query())
    assert [r.seq for r in first.rows] == list(range(1, 51)) and first.pages == N // 50

    by_reward = index.query(Query(sort="reward", desc=True, per_page=MAX_PER_PAGE))
    rewards = [r.reward for r in by_reward.rows]
    assert rewards == sorted(rewards, reverse=True)  # type: ignore[type-var]
    last_page = index.query(Query(sort="reward", desc=True, page=by_reward.pages, per_page=MAX_PER_PAGE))
    assert last_page.rows and all(r.reward is None for r in last_page.rows), "unscored rollouts must sort last"
    ascending = index.query(Query(sort="reward"))
    assert ascending.rows[0].reward is not None and ascending.rows[0].reward <= ascending.rows[1].reward  # type: ignore[operator]

    ok = index.query(Query(status="OK", env="code-tests@1", sort="duration", page=3))
    assert ok.matched == sum(1 for r in index.rows.values() if r.status == "OK" and r.env == "code-tests@1")
    assert all(r.status == "OK" and r.env == "code-tests@1" for r in ok.rows)
    durations = [r.duration for r in ok.rows]
    assert durations == sorted(durations) and len(durations) == 50

    one_task = index.query(Query(task="task-12345"))
    assert one_task.matched == 4 and {r.task_id for r in one_task.rows} == {"task-12345"}
    group = index.query(Query(group="job-many:task-7"))
    assert [r.sample_index for r in group.rows] == [0, 1, 2, 3]

    summary = index.by_status()
    assert sum(s.count for s in summary.values()) == N
    assert summary["OK"].mean_reward is not None and summary["INFRA_ERROR"].mean_reward is None
    _, width, counts = index.throughput(bins=40)
    assert sum(counts) == N and len(counts) == 40 and width > 0


def test_a_relogged_rollout_replaces_its_row() -> None:
    index = Index()
    [r] = list(many_rollouts(1))
    index.add([Row.of(r.model_dump(mode="json"), seq=1)])
    index.add([Row.of(r.model_dump(mode="json"), seq=9)])  # a group published late gets new seqs
    assert [row.seq for row in index.query(Query()).rows] == [9]


def test_junk_in_the_query_string_falls_back_to_defaults() -> None:
    q = Query.from_params({"sort": "payload; DROP", "page": "-3", "per_page": "1e9", "desc": "yes"})
    assert (q.sort, q.page, q.per_page, q.desc) == ("seq", 1, 50, False)
    q = Query.from_params({"sort": "turns", "page": "2", "per_page": "100000", "desc": "1", "status": "OK"})
    assert (q.sort, q.page, q.per_page, q.desc) == ("turns", 2, MAX_PER_PAGE, True)
    assert q.params(page=None) == {"status": "OK", "sort": "turns", "desc": "1", "per_page": str(MAX_PER_PAGE)}


async def test_rows_read_from_the_result_log_match_the_rollouts(tmp_path: Path) -> None:
    long = long_rollout(turns=6, job_id="j").model_copy(update={"id": "j:long:0", "task_id": "long"})
    rollouts = [*many_rollouts(30, job_id="j"), long]
    store = await ResultStore.open(tmp_path / "results.sqlite3")
    try:
        for r in rollouts:
            await store.append(r)
        db = sqlite3.connect(f"{(tmp_path / 'results.sqlite3').as_uri()}?mode=ro", uri=True)
        rows = read_rows(db, "j", 0)
        later = read_rows(db, "j", 28)
        db.close()
    finally:
        await store.close()
    assert rows == [Row.of(r.model_dump(mode="json"), seq=i + 1) for i, r in enumerate(rollouts)]
    assert [r.seq for r in later] == [29, 30, 31] and later[-1].turns == 7 and later[-1].reward == 1.0


def test_a_query_reads_the_rows_as_they_were_when_it_started() -> None:
    # the viewer serves a thread a request: an add on one thread changed the dict another thread's query was walking
    # ("dictionary changed size during iteration", the page failed), or cached its old order after the drop
    index = Index()
    index.add([Row(1, "j:t:0", "j", "e@1", "t", "j:t", 0, "OK", 1.0, 1, 1.0, 1.0)])

    class AddsWhileRead(str):
        """A status whose comparison, mid-query, adds a row as another thread would."""

        def __eq__(self, other: object) -> bool:
            if len(index.rows) < 3:
                index.add(
                    [
                        Row(
                            len(index.rows) + 1,
                            f"j:t:{len(index.rows)}",
                            "j",
                            "e@1",
                            "t",
                            "j:t",
                            0,
                            "OK",
                            1.0,
                            1,
                            1.0,
                            2.0,
                        )
                    ]
                )
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    index.add([Row(2, "j:t:1", "j", "e@1", "t", "j:t", 1, AddsWhileRead("OK"), 1.0, 1, 1.0, 1.0)])
    page = index.query(Query(status="OK"))
    assert page.matched == 2  # the rows as they were when it began
    assert index.query(Query(status="OK")).matched == len(index.rows) == 3  # and the next query sees the new one
