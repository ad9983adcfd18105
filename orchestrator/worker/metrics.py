"""One metrics endpoint for the fleet: the control plane's own metrics, and each rollout worker's (its sandboxes, warm
pool and engine calls) as its heartbeats last carried them, in Prometheus's text format, labelled with the worker's
id and host. A worker lost drops out at once; its counters start again from zero under its next id, as a restarted
process's do."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# per worker; a snapshot is about 10 KB. A scrape parses each snapshot it has not seen and labels each sample with
# the worker's id and host: at 1 MiB, four workers' snapshots took 5 s of a scrape, holding the GIL
MAX_SNAPSHOT_BYTES = 256 << 10
Snapshots = Callable[[], Iterable[tuple[str, str, bytes]]]  # (worker id, host, Prometheus text) of each worker


class FleetCollector:
    """Collects `own` and the workers' snapshots into one set of metric families.

    A worker's snapshot is parsed and labelled once, when it first appears (a worker sends a new one every few
    heartbeats): parsed again at each scrape, a control plane of 1,024 workers spent 2.6 s of every scrape on it,
    holding the GIL from its event loop, and each scraper more (the endpoint has no authentication)."""

    def __init__(self, own: CollectorRegistry, snapshots: Snapshots) -> None:
        self._own = own
        self._snapshots = snapshots
        # worker id -> (the snapshot, its families with the worker's labels); replaced whole, so that scrapes on
        # several threads at once each read a consistent dict
        self._parsed: dict[str, tuple[bytes, list[Metric]]] = {}

    def collect(self) -> Iterator[Metric]:
        families = {f.name: f for f in self._own.collect()}
        cached, parsed = self._parsed, {}
        for worker_id, host, text in self._snapshots():
            seen = cached.get(worker_id)
            labelled = seen[1] if seen is not None and seen[0] is text else _labelled(worker_id, host, text)
            parsed[worker_id] = (text, labelled)
            for family in labelled:
                into = families.get(family.name)
                if into is None:
                    into = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                elif into.type != family.type:
                    continue  # the same name as another kind of metric: only from a worker of another release
                into.samples.extend(family.samples)
        self._parsed = parsed  # the workers gone since drop out
        yield from families.values()


def _labelled(worker_id: str, host: str, text: bytes) -> list[Metric]:
    """A worker's snapshot as metric families whose samples carry its id and host; none when it does not parse."""
    try:
        parsed = list(text_string_to_metric_families(text.decode()))
    except (ValueError, UnicodeDecodeError) as e:  # a worker of another release, or a bug: skip it alone
        log.warning("worker %s sent metrics that do not parse (%s); left out", worker_id, e)
        return []
    # the text format writes a counter's or histogram's creation time as a gauge family of its own, whose name would
    # clash with the `_created` samples of the control plane's family: left out
    timed = {f.name for f in parsed if f.type in ("counter", "histogram", "summary")}
    out = []
    for family in parsed:
        if family.name.endswith("_created") and family.name.removesuffix("_created") in timed:
            continue
        labelled = Metric(family.name, family.documentation, family.type, family.unit)
        for s in family.samples:
            labels = {**s.labels, "worker": worker_id, "host": host}
            labelled.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        out.append(labelled)
    return out


def fleet_registry(own: CollectorRegistry, snapshots: Snapshots) -> CollectorRegistry:
    """A registry to serve: `own` merged with the workers' snapshots at each scrape."""
    exposed = CollectorRegistry()
    exposed.register(FleetCollector(own, snapshots))
    return exposed
