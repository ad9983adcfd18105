"""The rollouts table's data: one small row per rollout, filtered, sorted and paged in memory.

A row holds only what the table shows (no turns, no tokens), so 100,000 rollouts are a few tens of megabytes and a
query over them takes tens of milliseconds; the full rollout is read back only when one is opened.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

SortKey = Literal["seq", "status", "reward", "env", "task", "turns", "duration"]
SORT_KEYS: tuple[SortKey, ...] = get_args(SortKey)
MAX_PER_PAGE = 500


@dataclass(frozen=True, slots=True)
class Row:
    """What the rollouts table shows of one rollout."""

    seq: int
    id: str
    job_id: str
    env: str
    task_id: str
    group_id: str
    sample_index: int
    status: str
    reward: float | None
    turns: int
    duration: float
    finished_at: float

    @classmethod
    def of(cls, data: dict[str, Any], seq: int) -> Row:
        """The row of a rollout decoded from its JSON (the store's payload or a JSONL line)."""
        reward = data.get("reward")
        return cls(
            seq=seq,
            id=str(data.get("id", "")),
            job_id=str(data.get("job_id", "")),
            env=str(data.get("env", "")),
            task_id=str(data.get("task_id", "")),
            group_id=str(data.get("group_id", "")),
            sample_index=int(data.get("sample_index", 0)),
            status=str(data.get("status", "")),
            reward=float(reward) if isinstance(reward, int | float) else None,
            turns=len(data.get("turns") or ()),
            duration=float((data.get("timing") or {}).get("total", 0.0)),
            finished_at=float(data.get("finished_at", 0.0)),
        )

    @classmethod
    def parse(cls, payload: str | bytes, seq: int) -> Row:
        """The row of one rollout's JSON text."""
        return cls.of(json.loads(payload), seq)


@dataclass(frozen=True)
class Query:
    """Filters, order and page of the rollouts table (all from the page's query string)."""

    status: str = ""
    env: str = ""
    task: str = ""  # a substring of the task id
    group: str = ""
    sort: SortKey = "seq"
    desc: bool = False
    page: int = 1
    per_page: int = 50

    @classmethod
    def from_params(cls, params: dict[str, str]) -> Query:
        """A query from URL parameters; anything unknown or out of range falls back to its default."""
        sort = params.get("sort", "seq")

        def number(name: str, default: int, hi: int) -> int:
            try:
                return min(max(int(params.get(name, default)), 1), hi)
            except ValueError:
                return default

        return cls(
            status=params.get("status", "")[:40],
            env=params.get("env", "")[:200],
            task=params.get("task", "")[:200],
            group=params.get("group", "")[:300],
            sort=sort if sort in SORT_KEYS else "seq",  # type: ignore[arg-type]
            desc=params.get("desc", "") == "1",
            page=number("page", 1, 1_000_000),
            per_page=number("per_page", 50, MAX_PER_PAGE),
        )

    def params(self, **change: object) -> dict[str, str]:
        """This query's URL parameters, with some changed (defaults left out)."""
        values = {
            "status": self.status,
            "env": self.env,
            "task": self.task,
            "group": self.group,
            "sort": "" if self.sort == "seq" else self.sort,
            "desc": "1" if self.desc else "",
            "page": "" if self.page == 1 else str(self.page),
            "per_page": "" if self.per_page == 50 else str(self.per_page),
        }
        for k, v in change.items():
            values[k] = str(v) if v not in (None, False) else ""
        return {k: v for k, v in values.items() if v}


@dataclass(frozen=True)
class Page:
    """One page of the filtered, sorted rows."""

    rows: list[Row]
    matched: int  # rows that pass the filters
    total: int  # rows of the job
    query: Query

    @property
    def pages(self) -> int:
        """How many pages the matched rows fill (at least one)."""
        return max(1, -(-self.matched // self.query.per_page))


def _key(sort: SortKey) -> Any:
    if sort == "reward":  # unscored rollouts (no reward) sort after every scored one, either way round
        return lambda r: (r.reward is None, r.reward or 0.0, r.seq)
    attr = {"task": "task_id"}.get(sort, sort)
    return lambda r: (getattr(r, attr), r.seq)


@dataclass
class StatusSummary:
    """Rollouts of one status: how many, and their mean reward (None when unscored)."""

    count: int = 0
    reward_sum: float = 0.0
    scored: int = 0

    @property
    def mean_reward(self) -> float | None:
        """The mean reward of the scored ones."""
        return self.reward_sum / self.scored if self.scored else None


@dataclass
class Index:
    """The rows of one job, keyed by rollout id (a re-logged rollout replaces its row)."""

    rows: dict[str, Row] = field(default_factory=dict)
    last_seq: int = 0
    _sorted: dict[tuple[str, str, str, str, SortKey, bool], list[Row]] = field(default_factory=dict)

    def add(self, rows: Iterable[Row]) -> None:
        """Add (or replace) rows; cached orders are dropped. The rows and the cache are new objects, never changed in
        place: another request's thread may be reading the ones it took (the viewer serves a thread a request), and
        a dict changed under it failed its page, or a query of the old rows cached its order after the drop."""
        new = list(rows)
        if not new:
            return
        table = dict(self.rows)
        for row in new:
            table[row.id] = row
            self.last_seq = max(self.last_seq, row.seq)
        self.rows, self._sorted = table, {}

    def query(self, q: Query) -> Page:
        """The page of rows that `q` asks for; a filter and order are cached, so paging through them is cheap."""
        key = (q.status, q.env, q.task, q.group, q.sort, q.desc)
        rows, cache = self.rows, self._sorted  # as they are now: an add makes new ones
        ordered = cache.get(key)
        if ordered is None:
            ordered = [
                r
                for r in rows.values()
                if (not q.status or r.status == q.status)
                and (not q.env or r.env == q.env)
                and (not q.task or q.task in r.task_id)
                and (not q.group or r.group_id == q.group)
            ]
            ordered.sort(key=_key(q.sort), reverse=q.desc)
            if q.sort == "reward" and q.desc:  # keep the unscored last when descending too
                cut = bisect.bisect_left([r.reward is not None for r in ordered], True)
                ordered = ordered[cut:] + ordered[:cut]
            if len(cache) > 16:
                cache.clear()
            cache[key] = ordered
        start = (q.page - 1) * q.per_page
        return Page(ordered[start : start + q.per_page], len(ordered), len(rows), q)

    def by_status(self) -> dict[str, StatusSummary]:
        """Counts and mean rewards by status."""
        out: dict[str, StatusSummary] = {}
        for r in list(self.rows.values()):
            s = out.setdefault(r.status, StatusSummary())
            s.count += 1
            if r.reward is not None:
                s.scored += 1
                s.reward_sum += r.reward
        return dict(sorted(out.items()))

    def envs(self) -> list[str]:
        """The environments of the rows."""
        return sorted({r.env for r in list(self.rows.values())})

    def throughput(self, bins: int = 40) -> tuple[float, float, list[int]]:
        """Rollouts finished per time bin: (start, bin width in seconds, counts); empty without finish times."""
        times = [r.finished_at for r in list(self.rows.values()) if r.finished_at > 0]
        if not times:
            return 0.0, 0.0, []
        lo, hi = min(times), max(times)
        width = max((hi - lo) / bins, 1e-3)
        counts = Counter(min(int((t - lo) / width), bins - 1) for t in times)
        return lo, width, [counts.get(i, 0) for i in range(bins)]
