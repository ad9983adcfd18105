"""The durable result log: jobs and scored rollouts in SQLite (WAL), with acks, resume and idempotent appends.

Every call runs on one dedicated thread that owns the connection, so the event loop never blocks on disk. Calls that
arrive together are run together, in one transaction: a burst of 200 submits or of finishing rollouts costs a few
commits and thread hops, not 200. Each call stays atomic, and fails alone: when one fails, the batch is run again with
a savepoint for each call (a batch of calls that all succeed, the usual case, needs none).

Commits are paced: while calls keep coming from many callers, a transaction starts COMMIT_GAP_S after the previous
one ended, so that calls arriving one by one (gRPC hands a burst of calls to the event loop one at a time, about a
millisecond apart) share a commit and a thread hop. A call after a quiet spell starts at once, and so does the next
call of a caller the last transaction served (one caller's calls in a row, as a job list or a resume makes them:
waiting would batch nothing). Unpaced, 200 concurrent SubmitJob calls on 2 cores each had a transaction and a hop of
their own, most of the handler's cost (README, "Why SubmitJob stays slow under a burst").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from orchestrator.core.echo import error_text
from orchestrator.core.errors import ConfigError
from orchestrator.core.models import EncodedRollout, JobSpec, JobState, Rollout
from orchestrator.core.policy import PolicyEndpoint

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_BATCH = 512  # calls per transaction
REMOVE_CHUNK = 2000  # rollouts deleted per call when a job is removed: a huge job does not hold the log's thread
COMMIT_GAP_S = 0.005  # while busy, the time from one transaction's end to the next one's start
# A rollout's row is about 3 KB (its JSON and its wire form): on 4 KB pages nearly a page each, which its insert and
# then its ack write out whole. On 16 KB pages a page holds five: the control plane's CPU per rollout at 3,000 a second
# went down 6-10%, its system time a quarter (bench/results.json, fleet.store_page_size); paced, no difference.
PAGE_SIZE = 16384
WAL_LIMIT_BYTES = 64 << 20  # what of the write-ahead log stays on disk once it is checkpointed
# the log's layout, stamped in SQLite's user_version: a log stamped by a newer envfleet is refused rather than read
# with what this one knows (read by an older one, a job lost its policy column: UpdatePolicy's endpoint went back to
# the submitted one, and again after the upgrade back). Logs from before the stamp read 0. Its rows hold the job spec
# and the rollout as JSON, which the models read strictly (extra fields refused): a change to their fields is a new
# layout (2: PolicyEndpoint.chat_template_kwargs, max_turns 0; an older version dropped each job it could not read),
# and tests/orchestrator/test_store.py pins their shape to the layout. 3: job_bytes, which an older version's appends
# and removals would leave behind the rows (caps.result_bytes_per_tenant counted wrong for good). 4:
# PolicyEndpoint.outage_wait_s (an older version refuses every job spec that carries it)
LOG_VERSION = 4
# the state of a job row whose removal is under way (never a JobState: an older version leaves such a row alone)
REMOVING = "REMOVING"
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    finished_at REAL,
    total INTEGER NOT NULL,
    owner TEXT NOT NULL DEFAULT 'local',
    policy TEXT
);
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    rollout_id TEXT NOT NULL UNIQUE,
    group_id TEXT NOT NULL,
    status TEXT NOT NULL,
    payload TEXT NOT NULL,
    acked INTEGER NOT NULL DEFAULT 0,
    visible INTEGER NOT NULL DEFAULT 1,
    wire BLOB
);
-- the bytes each job's rollouts hold (caps.result_bytes_per_tenant), kept as they are appended and slimmed: summed
-- from the rows, a start read the whole log (a payload's byte length is no column SQLite can read without it)
CREATE TABLE IF NOT EXISTS job_bytes (
    job_id TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_job_seq ON rollouts (job_id, visible, acked, seq);
CREATE INDEX IF NOT EXISTS rollouts_group_visible ON rollouts (job_id, group_id, visible);
DROP INDEX IF EXISTS rollouts_group;
"""
# The group index holds `visible`: a grouped job's publish check, at each append, counts its group's hidden rows in
# the index alone. On (job_id, group_id) SQLite chose the (job_id, visible, ...) index and read every hidden row of
# the job, each from the table: 0.9 ms an append with 64 groups of 64 in flight, about 1,100 grouped rollouts a second
# for the whole control plane. A log from before it (`rollouts_group`) gets the new index at its next open.
# Queries below that SQLite planned over a job's whole backlog name their index (INDEXED BY), or keep job_id off
# one (+job_id) so that the unique rollout_id index is used; tests/orchestrator/test_store.py checks each plan.

# An ack's up_to may cut a group: its members past up_to, unacked. The group is the last unacked one up to it (groups
# are acked whole, so an acked last row leaves nothing of its group to ack): the index finds it at once, where the
# last row of any kind was found by sorting every row of the job, 40 ms an Ack at 200,000 rows, on the one thread
# that every tenant's appends, reads and acks share. The outer query reads that group's rows only (by the group index):
# it read every unacked row of the job past up_to, 72 ms an Ack at 100,000 behind
CUT_GROUP_REST = (
    "SELECT seq FROM rollouts INDEXED BY rollouts_group_visible WHERE job_id = ? AND visible = 1 AND acked = 0 "
    "AND seq > ? AND group_id = (SELECT group_id FROM rollouts WHERE job_id = ? AND visible = 1 AND acked = 0 "
    "AND seq <= ? ORDER BY seq DESC LIMIT 1)"
)
# Acks by id: by the unique rollout_id index (+job_id keeps the job's index out of the plan, which read every unacked
# row of the job up to `delivered` once a chunk of 500 ids: 0.37 s for 5,000 ids at 100,000 behind); for whole
# groups, the ids' groups, then their rows by the group index
ACK_IDS = (
    "SELECT seq FROM rollouts WHERE rollout_id IN ({marks}) AND +job_id = ? AND visible = 1 AND acked = 0 AND seq <= ?"
)
ACK_ID_GROUPS = (
    "SELECT seq, group_id FROM rollouts INDEXED BY rollouts_group_visible WHERE job_id = ? AND visible = 1 "
    "AND acked = 0 AND group_id IN (SELECT group_id FROM rollouts WHERE rollout_id IN ({marks}) AND +job_id = ? "
    "AND seq <= ?)"
)
# what an ack does to a row: marks it; or, slim, also drops its episode (turns, tokens: nearly all of its bytes) and
# its wire form, which only streams read, and streams read no acked row
ACKED = {
    "keep": "UPDATE rollouts SET acked = 1",
    # a row whose JSON is damaged (a stream sends its wire bytes without reading it) keeps it: json_remove refused
    # it, and every ack that reached the row failed, its rows sent again for ever
    "slim": "UPDATE rollouts SET acked = 1, wire = NULL, payload = CASE WHEN json_valid(payload) "
    "THEN json_remove(payload, '$.turns', '$.tokens') ELSE payload END",
}
# the bytes rows hold (caps.result_bytes_per_tenant): their JSON and their wire form. It reads every payload whole:
# only for a job without a job_bytes row (logged before there was one), and for the rows a slim ack changes
STORED_BYTES = "COALESCE(SUM(LENGTH(CAST(payload AS BLOB)) + COALESCE(LENGTH(wire), 0)), 0)"
ADD_BYTES = (
    "INSERT INTO job_bytes (job_id, bytes) VALUES (?, ?) "
    "ON CONFLICT (job_id) DO UPDATE SET bytes = bytes + excluded.bytes"
)
# the unacked rows of the group a row belongs to (an ack that cuts a group whose parts are not all sent)
GROUP_OF = (
    "SELECT seq FROM rollouts INDEXED BY rollouts_group_visible WHERE job_id = ? AND visible = 1 AND acked = 0 "
    "AND group_id = (SELECT group_id FROM rollouts WHERE seq = ?)"
)


def _scores(wanted: bool, *, checked: bool) -> str:
    """The columns a group's advantages are made of, read out of a row's JSON by SQLite; `checked`: null for a row
    whose JSON is damaged, where json_extract raises (a second parse of each row: only after that happened)."""
    if not wanted:
        return ""
    fields = [f"json_extract(payload, '$.{f}')" for f in ("reward", "task_id")]
    if checked:
        fields = [f"CASE WHEN json_valid(payload) THEN {f} END" for f in fields]
    return ", " + ", ".join(fields)


@dataclass(frozen=True)
class StoredJob:
    """A job row."""

    job_id: str
    spec: JobSpec
    state: JobState
    created_at: float
    finished_at: float | None
    total: int
    owner: str = "local"  # the tenant that submitted it


@dataclass(frozen=True)
class LogEntry:
    """A rollout as read back from the log."""

    seq: int
    group_id: str
    payload: str  # the Rollout as JSON (without its seq)
    wire: bytes | None = None  # its trainer wire form as the worker that ran it encoded it; None: convert `payload`
    rollout_id: str = ""
    job_id: str = ""
    status: str = ""  # the RolloutStatus' value, as logged
    # read for group delivery only (read's `scores`): what the group's advantages are made of, out of the JSON
    reward: float | None = None
    task_id: str = ""

    def rollout(self) -> Rollout:
        """Decode the payload, with its seq."""
        r = Rollout.model_validate_json(self.payload)
        r.seq = self.seq
        return r


class ResultStore:
    """Append scored rollouts, read them from a cursor, ack them. Open with `await ResultStore.open(path)`."""

    def __init__(
        self, path: Path, synchronous: Literal["full", "normal"] = "full", acked: Literal["keep", "slim"] = "keep"
    ) -> None:
        self.path = path
        self._synchronous = synchronous
        self._acked = acked
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="result-store")
        self._db: sqlite3.Connection | None = None
        # each call with its future and the task that made it
        self._queue: list[tuple[Callable[[], Any], asyncio.Future[Any], asyncio.Task[Any] | None]] = []
        self._drainer: asyncio.Task[None] | None = None
        self._last_end = float("-inf")  # loop time when the last transaction ended
        self._served: set[asyncio.Task[Any] | None] = set()  # the callers of the last transaction
        # the job rows the last `jobs()` could not read, by id: their end (None: unfinished), which retention reads
        self.unreadable: dict[str, float | None] = {}
        # the jobs whose removal the last `jobs()` found under way (cut short by a stop or a crash)
        self.removing: list[str] = []
        # what this transaction's calls changed of each job's bytes (job_bytes), written once per job at its end
        self._bytes: collections.Counter[str] = collections.Counter()

    @classmethod
    async def open(
        cls, path: Path, synchronous: Literal["full", "normal"] = "full", acked: Literal["keep", "slim"] = "keep"
    ) -> ResultStore:
        """Open (creating if needed) the log at `path`. `synchronous` full: each commit is synced to disk before
        its rows are read (and streamed); normal (SQLite's WAL mode's): a commit survives a crash of the process
        but may be lost with the host's power. Lost so, rollouts a trainer had read and acked came again under new
        seqs from a rerun, past its dedup, and its cursor, past the log's end now, was refused. `acked` slim: an
        acked rollout keeps its record (status, reward, metrics, timing, provenance) but not its turns and tokens,
        which no stream sends again: a job that runs for weeks kept every episode it ever delivered."""
        store = cls(path, synchronous, acked)
        await asyncio.get_running_loop().run_in_executor(store._pool, store._connect)
        return store

    def _connect(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        stamped = db.execute("PRAGMA user_version").fetchone()[0]
        if stamped > LOG_VERSION:
            db.close()
            raise ConfigError(
                f"the result log {self.path} was written by a newer envfleet (layout {stamped}; this one reads up to "
                f"{LOG_VERSION}): run that version, or a newer one, on this data directory"
            )
        old = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'rollouts'").fetchone() is not None
        if old and db.execute("SELECT 1 FROM sqlite_master WHERE name = 'rollouts_group_visible'").fetchone() is None:
            log.info(
                "result log %s: building its group index (once, after an upgrade; a large log takes a while)", self.path
            )
        db.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a new log's; one made before keeps its own
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={self._synchronous.upper()}")
        # the WAL grows to the largest transaction's size and kept it for good (a group of 1,024 samples of 8 MiB
        # published at once: 8 GiB on the host's disk, after the rows were checkpointed); cut back at each reset
        db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        db.executescript(SCHEMA)
        job_columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        if "owner" not in job_columns:  # a log from before tenants
            db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT 'local'")
        if "policy" not in job_columns:  # before policy updates had a column of their own
            db.execute("ALTER TABLE jobs ADD COLUMN policy TEXT")
        if "wire" not in {row[1] for row in db.execute("PRAGMA table_info(rollouts)")}:  # before workers' bytes
            db.execute("ALTER TABLE rollouts ADD COLUMN wire BLOB")
        # a job's count made by an append that came after its removal (a cancelled rollout's, queued)
        db.execute("DELETE FROM job_bytes WHERE job_id NOT IN (SELECT job_id FROM jobs)")
        if stamped < LOG_VERSION:
            db.execute(f"PRAGMA user_version = {LOG_VERSION}")
        self._db = db

    async def _run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the store's thread, in the next transaction."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.append((fn, future, asyncio.current_task()))
        if self._drainer is None or self._drainer.done():
            self._drainer = loop.create_task(self._drain(), name="result store")
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            if (wait := self._linger(loop.time())) > 0:
                await asyncio.sleep(wait)  # the calls that arrive meanwhile join this transaction
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            try:
                results = await loop.run_in_executor(self._pool, self._transaction, [fn for fn, _, _ in batch])
            except BaseException as e:  # the transaction itself failed (disk full, the store closed)
                results = [(False, e)] * len(batch)
            self._last_end = loop.time()
            self._served = {caller for _, _, caller in batch}
            for (_, future, _), (ok, value) in zip(batch, results, strict=True):
                if future.done():
                    continue  # its caller was cancelled; the call ran all the same, as a thread's would
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

    def _linger(self, now: float) -> float:
        """How long the next transaction waits for more calls: the rest of COMMIT_GAP_S, or 0 after a quiet spell or
        when every queued call is the next step of a caller the last transaction served."""
        wait = self._last_end + COMMIT_GAP_S - now
        if wait <= 0 or all(caller in self._served for _, _, caller in self._queue):
            return 0.0
        return wait

    def _transaction(self, calls: list[Callable[[], Any]]) -> list[tuple[bool, Any]]:
        db = self.db
        self._bytes.clear()
        db.execute("BEGIN IMMEDIATE")
        try:
            try:
                # optimistic: calls rarely fail, and a savepoint each costs about a quarter of an insert
                results: list[tuple[bool, Any]] = [(True, fn()) for fn in calls]
            except Exception:
                db.execute("ROLLBACK")  # every call of the batch undone; run them again, each in its savepoint
                self._bytes.clear()
                db.execute("BEGIN IMMEDIATE")
                results = [self._isolated(fn) for fn in calls]
            # one write a job a transaction (one an append cost about 40% more than the insert)
            db.executemany(ADD_BYTES, [(job_id, n) for job_id, n in self._bytes.items() if n])
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return results

    def _isolated(self, fn: Callable[[], Any]) -> tuple[bool, Any]:
        db = self.db
        counted = self._bytes.copy()
        db.execute("SAVEPOINT call")
        try:
            return True, fn()
        except Exception as e:
            db.execute("ROLLBACK TO call")
            self._bytes = counted
            return False, e
        finally:
            db.execute("RELEASE call")

    def size_bytes(self) -> int:
        """The log's files on disk: the database and its write-ahead log."""
        total = 0
        for path in (self.path, self.path.with_name(self.path.name + "-wal")):
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

    @property
    def db(self) -> sqlite3.Connection:
        assert self._db is not None, "store is not open"
        return self._db

    async def close(self) -> None:
        """Close the connection."""
        if self._drainer is not None:
            await asyncio.gather(self._drainer, return_exceptions=True)
        if self._db is not None:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.db.close)
            self._db = None
        self._pool.shutdown(wait=True)

    # -- jobs

    async def create_job(self, job_id: str, spec: JobSpec, total: int, owner: str = "local") -> None:
        """Record a new job of tenant `owner`."""

        def q() -> None:
            self.db.execute(
                "INSERT INTO jobs (job_id, spec, state, created_at, total, owner) VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, spec.model_dump_json(), JobState.QUEUED.value, time.time(), total, owner),
            )
            self.db.execute("INSERT OR REPLACE INTO job_bytes (job_id, bytes) VALUES (?, 0)", (job_id,))

        await self._run(q)

    async def mark_removing(self, job_ids: Sequence[str]) -> None:
        """Mark jobs whose removal is about to begin (REMOVING): one cut short, by a crash or a cancelled caller,
        before its own turn came is finished at the next start, as `remove_job`'s own mark makes it."""
        await self._run(
            lambda: self.db.executemany("UPDATE jobs SET state = ? WHERE job_id = ?", [(REMOVING, j) for j in job_ids])
        )

    async def remove_job(self, job_id: str) -> None:
        """Delete a job and its rollouts, a chunk of rows per call so that the calls of running jobs go between.
        The job's row is marked first (REMOVING) and goes last, so a removal cut short by a crash is found and
        finished at the next start (`removing`): a job removed before its retention ran out (a tenant's finished
        jobs over their cap) loaded again, with part of its rollouts, after it had answered NOT_FOUND."""
        await self.mark_removing([job_id])
        while await self._run(
            lambda: (
                self.db.execute(
                    "DELETE FROM rollouts WHERE seq IN (SELECT seq FROM rollouts WHERE job_id = ? LIMIT ?)",
                    (job_id, REMOVE_CHUNK),
                ).rowcount
            )
        ):
            pass
        await self._run(
            lambda: [self.db.execute(f"DELETE FROM {t} WHERE job_id = ?", (job_id,)) for t in ("jobs", "job_bytes")]
        )

    async def set_job_state(self, job_id: str, state: JobState) -> None:
        """Move a job to `state` (finished states stamp the time)."""
        finished = time.time() if state in (JobState.COMPLETED, JobState.CANCELLED) else None
        await self._run(
            lambda: self.db.execute(
                "UPDATE jobs SET state = ?, finished_at = COALESCE(?, finished_at) WHERE job_id = ?",
                (state.value, finished, job_id),
            )
        )

    async def update_policy(self, job_id: str, policy: PolicyEndpoint) -> None:
        """Keep a job's policy endpoint in force (an UpdatePolicy), in a column of its own that stands in for its
        spec's when the job is read: the whole spec written again (up to 100,000 task ids, ~13 MB) at every update
        was megabytes a call on the log's one thread and disk, at whatever rate a tenant called it."""
        await self._run(
            lambda: self.db.execute("UPDATE jobs SET policy = ? WHERE job_id = ?", (policy.model_dump_json(), job_id))
        )

    async def jobs(self, states: Iterable[JobState] | None = None) -> list[StoredJob]:
        """Every job, or those in `states`, oldest first."""

        def q() -> list[StoredJob]:
            rows = self.db.execute(
                "SELECT job_id, spec, state, created_at, finished_at, total, owner, policy FROM jobs "
                "ORDER BY created_at"
            ).fetchall()
            wanted = {s.value for s in states} if states is not None else None
            jobs = []
            self.unreadable = {}
            self.removing = [r[0] for r in rows if r[2] == REMOVING]
            for r in rows:
                if r[2] == REMOVING or (wanted is not None and r[2] not in wanted):
                    continue
                try:
                    spec = JobSpec.model_validate_json(r[1])
                    if r[7] is not None:  # checked with the spec when it was set (JobManager.update_policy)
                        spec = spec.model_copy(update={"policy": PolicyEndpoint.model_validate_json(r[7])})
                    jobs.append(StoredJob(r[0], spec, JobState(r[2]), r[3], r[4], r[5], r[6]))
                except ValueError as e:
                    # a row this version cannot read (a validator tightened since, a damaged row): left in the log
                    # as it is, for a version that can; one such row stopped the server's start. Said without the
                    # values it holds (pydantic quotes them: an api_key among them)
                    log.error("job %s in the result log does not load, so it is left alone: %s", r[0], error_text(e))
                    self.unreadable[r[0]] = r[4]
            return jobs

        return await self._run(q)

    # -- rollouts

    async def append(self, rollout: Rollout | EncodedRollout, *, visible: bool = True) -> int | None:
        """Append a scored rollout; returns its seq, or None when that rollout id is already in the log.

        An encoded rollout (from a worker) is stored as it came: its JSON, and its wire form for the stream. An
        invisible rollout is durable but not streamed yet: group delivery publishes a group once it is whole.
        """
        appended = await self.append_sized(rollout, visible=visible)
        return None if appended is None else appended[0]

    async def append_sized(self, rollout: Rollout | EncodedRollout, *, visible: bool = True) -> tuple[int, int] | None:
        """`append`, returning the seq and the bytes the row holds (its JSON and its wire form: `stored_bytes`)."""
        if isinstance(rollout, EncodedRollout):
            payload, wire = rollout.json, rollout.wire or None
        else:
            payload, wire = rollout.model_dump_json(exclude={"seq"}), None
        size = len(payload.encode()) + len(wire or b"")

        def q() -> tuple[int, int] | None:
            cur = self.db.execute(
                "INSERT OR IGNORE INTO rollouts (job_id, rollout_id, group_id, status, payload, visible, wire) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (rollout.job_id, rollout.id, rollout.group_id, rollout.status.value, payload, int(visible), wire),
            )
            if not cur.rowcount:
                return None
            self._bytes[rollout.job_id] += size
            return cur.lastrowid or 0, size

        return await self._run(q)

    async def publish_complete_groups(self, job_id: str, group_size: int, group_id: str | None = None) -> int:
        """Make whole groups visible, moved to the end of the log with consecutive seqs; returns how many.

        Consecutive seqs keep `ack up_to` safe: every visible seq below a delivered one was delivered before it.
        """

        def q() -> int:
            db = self.db
            # atomic: each call runs in a savepoint of the store's transaction
            sql = "SELECT group_id FROM rollouts WHERE job_id = ? AND visible = 0"
            args: tuple[object, ...] = (job_id,)
            if group_id is not None:  # at each append of a grouped job: its group's rows, in the index alone
                sql = (
                    "SELECT group_id FROM rollouts INDEXED BY rollouts_group_visible "
                    "WHERE job_id = ? AND group_id = ? AND visible = 0"
                )
                args += (group_id,)
            groups = [g for (g,) in db.execute(sql + " GROUP BY group_id HAVING COUNT(*) >= ?", (*args, group_size))]
            for g in groups:
                rows = db.execute(
                    "SELECT rollout_id, status, payload, wire FROM rollouts WHERE job_id = ? AND group_id = ? "
                    "ORDER BY seq",
                    (job_id, g),
                ).fetchall()
                db.execute("DELETE FROM rollouts WHERE job_id = ? AND group_id = ?", (job_id, g))
                db.executemany(
                    "INSERT INTO rollouts (job_id, rollout_id, group_id, status, payload, visible, wire) "
                    "VALUES (?, ?, ?, ?, ?, 1, ?)",
                    [(job_id, rid, g, status, payload, wire) for rid, status, payload, wire in rows],
                )
            return len(groups)

        return await self._run(q)

    async def done_ids(self, job_id: str) -> set[str]:
        """Rollout ids already in the log for a job (not to be redone on resume)."""
        return await self._run(
            lambda: {r[0] for r in self.db.execute("SELECT rollout_id FROM rollouts WHERE job_id = ?", (job_id,))}
        )

    async def read(
        self, job_id: str, after: int, limit: int, max_bytes: int | None = None, *, scores: bool = False
    ) -> list[LogEntry]:
        """Unacked rollouts of a job with seq > after, in seq order: at most `limit`, and with `max_bytes`, none
        after the one that takes them past it. Rows are read one by one, so a read stops where it is cut: read whole
        and cut after, a backlog of 10,000 rows of 200 KB was 2 GB read (and held) on the log's one thread for each
        message of 3 MiB. With `scores`, each entry's reward and task too (SQLite's JSON reader, not a model)."""

        def q() -> list[LogEntry]:
            try:
                return fetch(_scores(scores, checked=False))
            except sqlite3.OperationalError:  # a damaged row's JSON (json_extract raises): read again, checked
                return fetch(_scores(scores, checked=True))

        def fetch(extra: str) -> list[LogEntry]:
            rows = self.db.execute(
                f"SELECT seq, group_id, payload, wire, rollout_id, job_id, status{extra} FROM rollouts "
                "WHERE job_id = ? AND visible = 1 AND acked = 0 AND seq > ? ORDER BY seq LIMIT ?",
                (job_id, after, limit),
            )
            if max_bytes is None:
                return [LogEntry(*r) for r in rows]
            out: list[LogEntry] = []
            total = 0
            for r in rows:
                entry = LogEntry(*r)
                out.append(entry)
                # characters, at most the bytes _within_bytes counts: it never stops before the cut
                total += len(entry.wire) if entry.wire is not None else len(entry.payload)
                if total > max_bytes:
                    break
            return out

        return await self._run(q)

    async def group_scores(self, job_id: str, group_id: str) -> tuple[str, list[tuple[int, str, float | None]]]:
        """A published group's task and each member's (seq, status, reward), in seq order, acked or not: what its
        advantages are made of, without the members' whole JSON."""

        def q() -> tuple[str, list[tuple[int, str, float | None]]]:
            try:
                found = scored(_scores(True, checked=False))
            except sqlite3.OperationalError:  # a damaged row's JSON: read again, checked
                found = scored(_scores(True, checked=True))
            return (found[0][3] if found else ""), [(seq, status, reward) for seq, status, reward, _ in found]

        def scored(extra: str) -> list[Any]:
            return self.db.execute(
                f"SELECT seq, status{extra} FROM rollouts WHERE job_id = ? AND group_id = ? AND visible = 1 "
                "ORDER BY seq",
                (job_id, group_id),
            ).fetchall()

        return await self._run(q)

    async def resume_point(self, job_id: str, seq: int, *, grouped: bool) -> int | None:
        """Where a stream resuming after `seq` reads on from: `seq` itself when it is a published rollout of this
        job, acked or not, except inside a group that goes on past it (delivered in groups), where the seq before the
        group's first, so that the group is sent again whole; None when `seq` is no rollout of this job."""

        def q() -> int | None:
            row = self.db.execute(
                "SELECT group_id FROM rollouts WHERE seq = ? AND job_id = ? AND visible = 1", (seq, job_id)
            ).fetchone()
            if row is None or not grouped:
                return None if row is None else seq
            first, last = self.db.execute(
                "SELECT MIN(seq), MAX(seq) FROM rollouts INDEXED BY rollouts_group_visible "
                "WHERE job_id = ? AND group_id = ? AND visible = 1",
                (job_id, row[0]),
            ).fetchone()
            return seq if last == seq else int(first) - 1

        return await self._run(q)

    async def next_group(self, job_id: str, after: int) -> str | None:
        """The group of the job's first unacked rollout with seq > after (None: none is logged yet)."""

        def q() -> str | None:
            row = self.db.execute(
                "SELECT group_id FROM rollouts WHERE job_id = ? AND visible = 1 AND acked = 0 AND seq > ? "
                "ORDER BY seq LIMIT 1",
                (job_id, after),
            ).fetchone()
            return None if row is None else str(row[0])

        return await self._run(q)

    async def ack(
        self, job_id: str, up_to: int, ids: Iterable[str], *, delivered: int, whole_groups: bool = False
    ) -> list[int]:
        """`ack_sized`'s seqs."""
        return (await self.ack_sized(job_id, up_to, ids, delivered=delivered, whole_groups=whole_groups))[0]

    async def ack_sized(
        self, job_id: str, up_to: int, ids: Iterable[str], *, delivered: int, whole_groups: bool = False
    ) -> tuple[list[int], int]:
        """Ack every seq <= up_to and the given rollout ids among those delivered (seq <= `delivered`: an id is
        easily guessed, and one acked before it was sent would never be). With `whole_groups` a group is acked
        whole or not at all: a delivered id acks its group's every member once every part of the group is sent (one
        acked alone would leave the rest to go out as a part group), and an up_to inside a group acks none of it
        (a trainer that acked each message as it came, the last seq it held, lost the rest of every group that came
        in parts: acked whole, its parts on the wire or not sent yet were never sent again). Returns the seqs newly
        acked, and the bytes their rows gave up (slim; 0 where acked rows are kept whole)."""
        id_list = list(ids)
        by_ids = ACK_ID_GROUPS if whole_groups else ACK_IDS

        def q() -> tuple[list[int], int]:
            db = self.db
            # atomic: each call runs in a savepoint of the store's transaction
            seqs = [
                r[0]
                for r in db.execute(
                    "SELECT seq FROM rollouts WHERE job_id = ? AND visible = 1 AND acked = 0 AND seq <= ?",
                    (job_id, up_to),
                )
            ]
            if whole_groups:
                # a group is acked whole or not at all. A group's seqs are consecutive, so only the last group up_to
                # reaches may be cut, and none of it is acked: acked apart, its rest went out again as a part group
                # (its advantages made over the part); acked whole, its parts still on the wire, or not sent yet,
                # were lost with a broken stream. A later up_to at or past its last rollout acks it
                rest = [r[0] for r in db.execute(CUT_GROUP_REST, (job_id, up_to, job_id, up_to))]
                if rest:
                    cut = {r[0] for r in db.execute(GROUP_OF, (job_id, min(rest)))}
                    seqs = [seq for seq in seqs if seq not in cut]
            for i in range(0, len(id_list), 500):
                chunk = id_list[i : i + 500]
                marks = ",".join("?" * len(chunk))
                args = (job_id, *chunk, job_id, delivered) if whole_groups else (*chunk, job_id, delivered)
                rows = db.execute(by_ids.format(marks=marks), args).fetchall()
                if whole_groups:  # a group some of whose parts are not sent yet is not acked
                    unsent = {group for seq, group in rows if seq > delivered}
                    seqs += [seq for seq, group in rows if group not in unsent]
                else:
                    seqs += [r[0] for r in rows]
            seqs = sorted(set(seqs))
            freed, slim = 0, self._acked == "slim"
            for i in range(0, len(seqs), 500):
                chunk = seqs[i : i + 500]
                where = f"WHERE seq IN ({','.join('?' * len(chunk))})"
                held = f"SELECT {STORED_BYTES} FROM rollouts {where}"
                freed += db.execute(held, chunk).fetchone()[0] if slim else 0
                db.execute(f"{ACKED[self._acked]} {where}", chunk)
                freed -= db.execute(held, chunk).fetchone()[0] if slim else 0
            self._bytes[job_id] -= freed
            return seqs, freed

        return await self._run(q)

    async def last_seq(self, job_id: str) -> int:
        """The highest seq a stream of the job could have sent so far (0 when none)."""
        return await self._run(
            lambda: int(
                self.db.execute(
                    "SELECT COALESCE(MAX(seq), 0) FROM rollouts WHERE job_id = ? AND visible = 1", (job_id,)
                ).fetchone()[0]
            )
        )

    async def stored_bytes(self, job_id: str) -> int:
        """The bytes a job's rollouts hold in the log: each one's JSON and wire form (caps.result_bytes_per_tenant).
        A job logged before they were kept is counted from its rows, once."""

        def q() -> int:
            row = self.db.execute("SELECT bytes FROM job_bytes WHERE job_id = ?", (job_id,)).fetchone()
            if row is not None:
                return int(row[0])
            (n,) = self.db.execute(f"SELECT {STORED_BYTES} FROM rollouts WHERE job_id = ?", (job_id,)).fetchone()
            # what this transaction's calls logged of it is in the sum and is added at its end too
            self.db.execute("INSERT INTO job_bytes (job_id, bytes) VALUES (?, ?)", (job_id, n - self._bytes[job_id]))
            return int(n)

        return await self._run(q)

    async def published(self, job_id: str) -> int:
        """How many of a job's rollouts are visible: those a stream can send and an ack can reach (a group that was
        never whole is neither)."""
        return int(
            await self._run(
                lambda: self.db.execute(
                    "SELECT COUNT(*) FROM rollouts WHERE job_id = ? AND visible = 1", (job_id,)
                ).fetchone()[0]
            )
        )

    async def counts(self, job_id: str) -> tuple[dict[str, int], int]:
        """Rollouts by status, and how many are acked."""

        def q() -> tuple[dict[str, int], int]:
            by = dict(
                self.db.execute(
                    "SELECT status, COUNT(*) FROM rollouts WHERE job_id = ? GROUP BY status", (job_id,)
                ).fetchall()
            )
            (acked,) = self.db.execute(
                "SELECT COUNT(*) FROM rollouts WHERE job_id = ? AND acked = 1", (job_id,)
            ).fetchone()
            return by, int(acked)

        return await self._run(q)
