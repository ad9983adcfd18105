"""Prometheus metrics of one orchestrator, in a registry of its own (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

# up to an hour: a big job's queue wait, a tool call at its timeout and a large image's cold create pass a minute,
# and with 60 s the last bound every one of them was +Inf (a p50 of inf in `envfleet status`)
# `envfleet serve --metrics-port`'s default: taken (another server on this host), serve picks a free port and says
# so; a port the operator named that is taken is an error (Prometheus scraping it would read the other server)
DEFAULT_METRICS_PORT = 9464
LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    *(120, 300, 600, 1800, 3600),
)


class Metrics:
    """Every metric the orchestrator exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sandboxes = Gauge("envfleet_sandboxes", "Sandboxes by state", ["state"], registry=r)
        self.acquire_seconds = Histogram(
            "envfleet_sandbox_acquire_seconds",
            "Time to get a ready sandbox",
            ["source"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.create_seconds = Histogram(
            "envfleet_sandbox_create_seconds", "Cold create until envd is healthy", buckets=LATENCY_BUCKETS, registry=r
        )
        self.reset_seconds = Histogram(
            "envfleet_sandbox_reset_seconds",
            "In-place reset of a recycled sandbox",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.exec_seconds = Histogram(
            "envfleet_tool_exec_seconds", "Tool calls run in sandboxes", buckets=LATENCY_BUCKETS, registry=r
        )
        self.rollouts = Counter("envfleet_rollouts_total", "Finished rollouts by status", ["status"], registry=r)
        self.queue_depth = Gauge("envfleet_queue_depth", "Work items waiting for a slot", registry=r)
        # sessions' and the raw sandbox API's sandboxes: made outside the pool, in no other sandbox gauge, they took
        # the host's capacity unseen (a tenant holding raw sandboxes filled the host while busy read 0)
        self.sandboxes_held = Gauge(
            "envfleet_sandboxes_held", "Sandboxes of sessions and the raw sandbox API, held now", registry=r
        )
        self.queue_wait_seconds = Histogram(
            "envfleet_queue_wait_seconds", "Time work items waited", buckets=LATENCY_BUCKETS, registry=r
        )
        self.in_flight = Gauge("envfleet_rollouts_in_flight", "Rollouts running now", registry=r)
        self.pool_idle = Gauge("envfleet_pool_idle", "Idle warm sandboxes by pool", ["pool"], registry=r)
        self.pool_target = Gauge("envfleet_pool_target", "Target warm size by pool", ["pool"], registry=r)
        self.pool_frozen = Gauge(
            "envfleet_pool_frozen",
            "Idle warm sandboxes frozen (idle past freeze_idle_after_s; of envfleet_sandboxes{state=idle})",
            registry=r,
        )
        self.pool_discards = Counter(
            "envfleet_pool_discards_total",
            "Sandboxes the warm pool destroyed rather than keep or hand out, by reason (expired: idle past its TTL or"
            " its lease about to end, probe: no answer to the health check before a hand-out, reset_failed, no_room,"
            " evicted: room for another pool, closed: came back after the pool closed)",
            ["reason"],
            registry=r,
        )
        self.pool_probes = Counter(
            "envfleet_pool_probes_total",
            "Health checks of warm sandboxes idle past probe_idle_after_s, before a hand-out, by outcome (alive;"
            " slow: no answer in probe_timeout_s, handed out all the same; gone: destroyed)",
            ["outcome"],
            registry=r,
        )
        self.jobs = Gauge(
            "envfleet_jobs",
            "Jobs the control plane keeps, by state (a finished one until job_retention_s after its end)",
            ["state"],
            registry=r,
        )
        self.jobs_removed = Counter(
            "envfleet_jobs_removed_total",
            "Finished jobs removed from memory and from the result log once job_retention_s after their end passed",
            registry=r,
        )
        self.result_log_bytes = Gauge(
            "envfleet_result_log_bytes", "The result log on disk: the database and its write-ahead log", registry=r
        )
        self.docker_errors = Counter("envfleet_docker_api_errors_total", "Failed engine calls", ["call"], registry=r)
        self.queue_waiting_for_images = Gauge(
            "envfleet_queue_waiting_for_images", "Queued work items held back until their image is built", registry=r
        )
        self.docker_api_limit = Gauge(
            "envfleet_docker_api_limit", "Engine calls allowed in flight now (cut when the engine slows)", registry=r
        )
        self.docker_api_in_flight = Gauge("envfleet_docker_api_in_flight", "Engine calls in flight", registry=r)
        self.docker_api_waiting = Gauge("envfleet_docker_api_waiting", "Engine calls waiting for a permit", registry=r)
        self.docker_engine_answering = Gauge(
            "envfleet_docker_engine_answering",
            "1 while the container engine answers, 0 while it does not (a rollout that needs it waits)",
            registry=r,
        )

    def export_workers(
        self,
        connected: Callable[[], int],
        slots: Callable[[], int],
        waiting: Callable[[], int],
        lost: Callable[[], int],
    ) -> None:
        """The rollout workers, read when scraped: with none connected or every slot taken, a rollout waits for one
        counted in flight (not in the queue) and the fleet looked busy and healthy while it ran nothing."""
        Gauge("envfleet_workers", "Rollout workers connected", registry=self.registry).set_function(connected)
        Gauge(
            "envfleet_worker_slots", "Rollouts the connected workers take at once", registry=self.registry
        ).set_function(slots)
        Gauge(
            "envfleet_rollouts_waiting_for_worker",
            "Rollouts waiting for a worker to connect or for a slot",
            registry=self.registry,
        ).set_function(waiting)
        self.registry.register(_LostWorkers(lost))

    def render(self) -> bytes:
        """The text exposition format."""
        return bytes(generate_latest(self.registry))


class _LostWorkers(Collector):
    """envfleet_workers_lost_total, the hub's own count (a counter read when scraped)."""

    def __init__(self, lost: Callable[[], int]) -> None:
        self._lost = lost

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "envfleet_workers_lost", "Rollout workers lost (stream ended or heartbeats stopped)", value=self._lost()
        )
