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

# per worker; a snapshot is about 10 KB. Each scrape parses every worker's snapshot again and labels each sample
# with the worker's id and host: at 1 MiB, four workers' snapshots took 5 s of a scrape, holding the GIL
MAX_SNAPSHOT_BYTES = 256 << 10
Snapshots = Callable[[], Iterable[tuple[str, str, bytes]]]  # (worker id, host, Prometheus text) of each worker


class FleetCollector:
    """Collects `own` and the workers' snapshots into one set of metric families."""

    def __init__(self, own: CollectorRegistry, snapshots: Snapshots) -> None:
        self._own = own
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        families = {f.name: f for f in self._own.collect()}
        for worker_id, host, text in self._snapshots():
            try:
                parsed = list(text_string_to_metric_families(text.decode()))
            except (ValueError, UnicodeDecodeError) as e:  # a worker of another release, or a bug: skip it alone
                log.warning("worker %s sent metrics that do not parse (%s); left out", worker_id, e)
                continue
            # the text format writes a counter's or histogram's creation time as a gauge family of its own, whose
            # name would clash with the `_created` samples of the control plane's family: left out
            timed = {f.name for f in parsed if f.type in ("counter", "histogram", "summary")}
            for family in parsed:
                if family.name.endswith("_created") and family.name.removesuffix("_created") in timed:
                    continue
                into = families.get(family.name)
                if into is None:
                    into = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                elif into.type != family.type:
                    continue  # the same name as another kind of metric: only from a worker of another release
                for s in family.samples:
                    labels = {**s.labels, "worker": worker_id, "host": host}
                    into.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from families.values()


def fleet_registry(own: CollectorRegistry, snapshots: Snapshots) -> CollectorRegistry:
    """A registry to serve: `own` merged with the workers' snapshots at each scrape."""
    exposed = CollectorRegistry()
    exposed.register(FleetCollector(own, snapshots))
    return exposed
