"""Log lines that an event of every rollout or turn would repeat: at most one a key a period, the rest counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

MAX_KEYS = 1024  # keys remembered; past them the least recently logged is forgotten (and may log again)


class LogLimit:
    """Says whether a line about `key` may be logged now: once per `period_s` for each key, and how many were held
    back since the last one (a tenant's server that ignores a request option, or a result log that refuses writes,
    wrote one line per turn or per rollout: gigabytes a day of one sentence)."""

    def __init__(self, period_s: float = 60.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self._clock = clock
        self._keys: dict[Hashable, tuple[float, int]] = {}  # key -> (when last logged, held back since)
        self._lock = threading.Lock()  # a stream's answer is read in a thread when it is large

    def allow(self, key: Hashable) -> str | None:
        """None while `key` was logged less than a period ago (the line counted); else "" or, when lines were held
        back, " (N more like it in the last S s)" to end the line with."""
        with self._lock:
            return self._allow(key, self._clock())

    def _allow(self, key: Hashable, now: float) -> str | None:
        last = self._keys.get(key)
        if last is not None and now - last[0] < self.period_s:
            self._keys[key] = (last[0], last[1] + 1)
            return None
        self._keys.pop(key, None)
        if len(self._keys) >= MAX_KEYS:
            del self._keys[next(iter(self._keys))]  # oldest logged first: a key goes to the end when it logs
        self._keys[key] = (now, 0)
        if last is None or not last[1]:
            return ""
        return f" ({last[1]} more like it in the last {now - last[0]:.0f} s)"
