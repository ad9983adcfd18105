"""Where the viewer reads from: a JSONL file of rollouts, or a live orchestrator's jobs and result log.

A source is called from the viewer's HTTP threads. The live one never touches the event loop's store connection: it
reads the log through its own read-only SQLite connection (WAL lets readers run beside the writer) and asks the
JobManager, on its loop, only which jobs a tenant may see.
"""

from __future__ import annotations

import asyncio
import collections
import sqlite3
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from orchestrator.core.echo import echo
from orchestrator.core.errors import ConfigError, JobNotFoundError, NotFoundError
from orchestrator.core.models import AdvantageMode, JobInfo, Rollout, RolloutStatus
from orchestrator.service.jobs import JobManager
from orchestrator.viewer.index import Index, Row

T = TypeVar("T")
LOOP_CALL_TIMEOUT_S = 10.0


# what a group page shows of a sample's last policy message (its tail)
LAST_TEXT_CHARS = 600


@dataclass(frozen=True)
class Sample:
    """What a group page shows of one sample: no turns, no tokens (a group of 1,024 long samples, decoded whole,
    was about 20 GiB of the control plane's memory for one page)."""

    id: str
    task_id: str
    sample_index: int
    status: RolloutStatus
    reward: float | None
    turns: int
    seconds: float
    error_kind: str | None
    last_text: str  # the last LAST_TEXT_CHARS characters of the last assistant turn with text

    @classmethod
    def of(cls, r: Rollout) -> Sample:
        last = next((t.text for t in reversed(r.turns) if t.role == "assistant" and t.text), "")
        kind = r.error.kind if r.error else None
        return cls(
            r.id,
            r.task_id,
            r.sample_index,
            r.status,
            r.reward,
            len(r.turns),
            r.timing.total,
            kind,
            last[-LAST_TEXT_CHARS:],
        )


@dataclass(frozen=True)
class JobView:
    """A job as the viewer shows it."""

    job_id: str
    env: str
    state: str
    total: int
    done: int
    by_status: dict[str, int]
    rollouts_per_s: float
    created_at: float = 0.0
    finished_at: float | None = None
    advantage: AdvantageMode = "grpo"
    group_size: int = 1
    policy: str = ""


@dataclass(frozen=True)
class Shown:
    """One rollout as its page shows it. `slim`: the log dropped its turns and tokens at its ack
    (`--result-log-acked slim`), so the page says so instead of showing an episode of no turns."""

    rollout: Rollout
    slim: bool = False


class Source(Protocol):
    """What the viewer reads. `tenant` None means every job (a local file); a tenant sees only its own jobs."""

    def jobs(self, tenant: str | None) -> list[JobView]:
        """The jobs the tenant may see."""
        ...

    def job(self, tenant: str | None, job_id: str) -> JobView:
        """One job; JobNotFoundError when missing or another tenant's."""
        ...

    def index(self, tenant: str | None, job_id: str) -> Index:
        """The job's rollouts table, up to date."""
        ...

    def rollout(self, tenant: str | None, job_id: str, rollout_id: str) -> Shown:
        """One rollout in full; NotFoundError when missing."""
        ...

    def group(self, tenant: str | None, job_id: str, group_id: str) -> list[Sample]:
        """The samples of one group, by sample index."""
        ...

    def close(self) -> None:
        """Release what the source holds open."""
        ...


@dataclass
class _FileJob:
    view: JobView
    index: Index = field(default_factory=Index)
    offsets: dict[str, int] = field(default_factory=dict)  # rollout id -> byte offset of its line


class FileSource:
    """The rollouts of a JSONL file (one Rollout per line, as `envfleet rollout` and `make demo` write)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._jobs: dict[str, _FileJob] = {}
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> None:
        by_job: dict[str, list[tuple[Row, int]]] = {}
        try:
            with self.path.open("rb") as f:
                offset = 0
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            row = Row.parse(line, seq=n)
                        except ValueError as e:
                            raise ConfigError(f"{self.path}:{n}: not a rollout ({e})") from None
                        by_job.setdefault(row.job_id, []).append((row, offset))
                    offset += len(line)
        except OSError as e:
            raise ConfigError(f"cannot read {self.path}: {e.strerror}") from None
        for job_id, rows in by_job.items():
            index = Index()
            index.add(r for r, _ in rows)
            counts: dict[str, int] = {s: v.count for s, v in index.by_status().items()}
            finished = [r.finished_at for r, _ in rows if r.finished_at]
            started = min(finished, default=0.0)
            span = max(finished, default=0.0) - started
            view = JobView(
                job_id=job_id,
                env=", ".join(index.envs()),
                state="FILE",
                total=len(rows),
                done=len(rows),
                by_status=counts,
                rollouts_per_s=len(rows) / span if span > 0 else 0.0,
                created_at=started,
                group_size=max((r.sample_index for r, _ in rows), default=0) + 1,
            )
            self._jobs[job_id] = _FileJob(view, index, {r.id: off for r, off in rows})

    def _job(self, job_id: str) -> _FileJob:
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(f"no job {echo(job_id)} in {self.path.name}")
        return job

    def jobs(self, tenant: str | None) -> list[JobView]:
        """Every job in the file."""
        return [j.view for j in self._jobs.values()]

    def job(self, tenant: str | None, job_id: str) -> JobView:
        """One job of the file."""
        return self._job(job_id).view

    def index(self, tenant: str | None, job_id: str) -> Index:
        """The job's rows (the file does not change under the viewer)."""
        return self._job(job_id).index

    def close(self) -> None:
        """Nothing is held open: each read opens the file."""

    def _read(self, offset: int) -> Rollout:
        with self._lock, self.path.open("rb") as f:
            f.seek(offset)
            return Rollout.model_validate_json(f.readline())

    def rollout(self, tenant: str | None, job_id: str, rollout_id: str) -> Shown:
        """One rollout, read back from its line."""
        offset = self._job(job_id).offsets.get(rollout_id)
        if offset is None:
            raise NotFoundError(f"no rollout {echo(rollout_id)} in job {echo(job_id)}")
        return Shown(self._read(offset))

    def group(self, tenant: str | None, job_id: str, group_id: str) -> list[Sample]:
        """The samples of one group (each rollout read whole, one at a time)."""
        job = self._job(job_id)
        rows = sorted((r for r in job.index.rows.values() if r.group_id == group_id), key=lambda r: r.sample_index)
        return [Sample.of(self._read(job.offsets[r.id])) for r in rows]


# The jobs whose rows a live viewer keeps indexed, the most recently viewed; another is indexed again from the log
# when viewed. Every job viewed was kept for good, removed ones too (a row per rollout, a million in a big job).
MAX_INDEXED_JOBS = 16


class LiveSource:
    """A running orchestrator's jobs (through its JobManager, per tenant) and result log (read-only SQLite)."""

    def __init__(self, jobs: JobManager, db_path: Path, loop: asyncio.AbstractEventLoop) -> None:
        self._manager = jobs
        self._db_path = db_path
        self._loop = loop
        self._indexes: collections.OrderedDict[str, Index] = collections.OrderedDict()  # least recently viewed first
        self._lock = threading.Lock()  # one read-only connection, used by one HTTP thread at a time
        self._conn: sqlite3.Connection | None = None

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(LOOP_CALL_TIMEOUT_S)

    def _db(self) -> sqlite3.Connection:
        """The connection; call with the lock held."""
        if self._conn is None:
            uri = f"{self._db_path.resolve().as_uri()}?mode=ro"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        return self._conn

    def close(self) -> None:
        """Close the connection to the result log."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def jobs(self, tenant: str | None) -> list[JobView]:
        """The tenant's jobs, oldest first."""
        infos = self._call(self._manager.list(owner=tenant))
        return sorted((_view(i) for i in infos), key=lambda j: j.created_at)

    def job(self, tenant: str | None, job_id: str) -> JobView:
        """One of the tenant's jobs; another tenant's is reported exactly like a missing one."""
        return _view(self._call(self._manager.info(job_id, owner=tenant)))

    def index(self, tenant: str | None, job_id: str) -> Index:
        """The job's rows, brought up to date with what was logged since the last look."""
        self.job(tenant, job_id)  # the tenant check
        with self._lock:
            index = self._indexes.setdefault(job_id, Index())
            self._indexes.move_to_end(job_id)
            while len(self._indexes) > MAX_INDEXED_JOBS:
                self._indexes.popitem(last=False)
            # a group published late is re-logged with new seqs: reading after the last seq picks it up
            index.add(read_rows(self._db(), job_id, index.last_seq))
            return index

    def indexed_jobs(self) -> list[str]:
        """The jobs whose rows are kept indexed now, least recently viewed first."""
        with self._lock:
            return list(self._indexes)

    def rollout(self, tenant: str | None, job_id: str, rollout_id: str) -> Shown:
        """One of the job's rollouts."""
        self.job(tenant, job_id)
        with self._lock:
            row = self._db().execute(_ROLLOUT_SQL, (job_id, rollout_id)).fetchone()
        if row is None:
            raise NotFoundError(f"no rollout {echo(rollout_id)} in job {echo(job_id)}")
        return Shown(_decode(row[:2]), slim=bool(row[2]))

    def group(self, tenant: str | None, job_id: str, group_id: str) -> list[Sample]:
        """The samples of one of the job's groups: their fields taken by SQLite's JSON functions, so no payload
        (turns, tokens) reaches Python."""
        self.job(tenant, job_id)
        with self._lock:
            return read_group(self._db(), job_id, group_id)


# A rollout whole, and whether an ack slimmed it: a logged rollout's JSON always names its turns, a slimmed one's not
# (store.ACKED)
_ROLLOUT_SQL = (
    "SELECT seq, payload, acked AND json_valid(payload) AND json_type(payload, '$.turns') IS NULL FROM rollouts "
    "WHERE job_id = ? AND rollout_id = ?"
)

# A group page's fields of each sample; the last assistant turn's text is cut in SQLite. A row that is no JSON (a
# damaged log) is left out, as one would fail the whole query
_GROUP_SQL = """
SELECT rollout_id, json_extract(payload, '$.task_id'), json_extract(payload, '$.sample_index'), status,
       json_extract(payload, '$.reward'), json_array_length(payload, '$.turns'),
       json_extract(payload, '$.timing.total'), json_extract(payload, '$.error.kind'),
       (SELECT substr(json_extract(t.value, '$.text'), -?) FROM json_each(payload, '$.turns') AS t
        WHERE json_extract(t.value, '$.role') = 'assistant' AND coalesce(json_extract(t.value, '$.text'), '') <> ''
        ORDER BY t.key DESC LIMIT 1)
FROM rollouts WHERE job_id = ? AND group_id = ? AND json_valid(payload) ORDER BY seq
"""

# The table's fields, extracted by SQLite's JSON functions: no payload (turns, tokens) reaches Python for the table.
_ROW_SQL = """
SELECT seq, rollout_id, job_id, json_extract(payload, '$.env'), json_extract(payload, '$.task_id'), group_id,
       json_extract(payload, '$.sample_index'), status, json_extract(payload, '$.reward'),
       json_array_length(payload, '$.turns'), json_extract(payload, '$.timing.total'),
       json_extract(payload, '$.finished_at')
FROM rollouts WHERE job_id = ? AND seq > ? ORDER BY seq
"""


def read_group(db: sqlite3.Connection, job_id: str, group_id: str) -> list[Sample]:
    """A group's samples, by sample index, from a result log connection (_GROUP_SQL)."""
    samples = [
        Sample(
            rid,
            task or "",
            int(index or 0),
            RolloutStatus(status),
            None if reward is None else float(reward),
            int(turns or 0),
            float(seconds or 0.0),
            kind,
            last or "",
        )
        for rid, task, index, status, reward, turns, seconds, kind, last in db.execute(
            _GROUP_SQL, (LAST_TEXT_CHARS, job_id, group_id)
        )
    ]
    return sorted(samples, key=lambda s: s.sample_index)


def read_rows(db: sqlite3.Connection, job_id: str, after_seq: int) -> list[Row]:
    """The table rows of a job's rollouts logged after `after_seq`, from a result log connection."""
    return [
        Row(
            seq=seq,
            id=rid,
            job_id=job,
            env=env or "",
            task_id=task or "",
            group_id=group,
            sample_index=int(sample or 0),
            status=status,
            reward=None if reward is None else float(reward),
            turns=int(turns or 0),
            duration=float(total or 0.0),
            finished_at=float(finished or 0.0),
        )
        for seq, rid, job, env, task, group, sample, status, reward, turns, total, finished in db.execute(
            _ROW_SQL, (job_id, after_seq)
        )
    ]


def _decode(row: tuple[int, str]) -> Rollout:
    rollout = Rollout.model_validate_json(row[1])
    rollout.seq = row[0]
    return rollout


def _view(info: JobInfo) -> JobView:
    done = info.counts.done
    return JobView(
        job_id=info.job_id,
        env=info.spec.env,
        state=info.state.value,
        total=info.counts.total,
        done=done,
        by_status={str(k): v for k, v in info.counts.by_status.items()},
        rollouts_per_s=info.counts.rollouts_per_s,
        created_at=info.created_at,
        finished_at=info.finished_at,
        advantage=info.spec.advantage,
        group_size=info.spec.group_size,
        policy=f"{info.spec.policy.model} {info.spec.policy.version}".strip(),
    )
