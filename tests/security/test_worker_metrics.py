"""A worker's metrics reach the control plane's endpoint from its heartbeats. A remote worker (another host, maybe
another release) must not break the scrape, forge the control plane's own series, or make it hold much memory."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.core.metrics import Metrics
from orchestrator.worker import metrics as worker_metrics
from orchestrator.worker.metrics import MAX_SNAPSHOT_BYTES, fleet_registry
from tests.orchestrator.backends.test_call_limiter import until
from tests.orchestrator.worker_wire import ScriptedWorker, serve_hub


async def _nothing(_: object) -> None:
    return None


async def test_a_workers_metrics_cannot_break_forge_or_bloat_the_endpoint() -> None:
    own = Metrics()
    own.rollouts.labels("OK").inc(3)
    forged = b'# TYPE envfleet_rollouts_total counter\nenvfleet_rollouts_total{status="OK"} 1e9\n'
    bloated = b"#" * (MAX_SNAPSHOT_BYTES + 1)
    async with serve_hub(heartbeat_timeout_s=30.0) as w:
        scrape = fleet_registry(own.registry, w.hub.metric_snapshots)
        async with (
            ScriptedWorker(w.tcp, _nothing, worker_id="forger", heartbeat_s=0.1, metrics=forged),
            ScriptedWorker(w.tcp, _nothing, worker_id="garbled", heartbeat_s=0.1, metrics=b"{{{ not metrics\n"),
            ScriptedWorker(w.tcp, _nothing, worker_id="bloated", heartbeat_s=0.1, metrics=bloated),
        ):
            await w.hub.wait_for_workers(3, timeout_s=30)
            # every snapshot has arrived: the bloated one was refused (None), the other two are kept
            await until(lambda: w.hub._workers["bloated"].metrics is None, timeout_s=30)
            await until(lambda: len(w.hub.metric_snapshots()) == 2, timeout_s=30)
            text = generate_latest(scrape).decode()
            snapshots = {worker for worker, _, _ in w.hub.metric_snapshots()}
    # the oversized snapshot is not kept; the garbled one is left out of the scrape, which still parses
    assert snapshots == {"forger", "garbled"}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    # the control plane's own series keeps its value; the worker's claim stands apart, under its own name
    assert samples[("envfleet_rollouts_total", (("status", "OK"),))] == 3.0
    forged_key = ("envfleet_rollouts_total", (("host", "scripted-host"), ("status", "OK"), ("worker", "forger")))
    assert samples[forged_key] == 1e9
    assert not any(dict(labels).get("worker") == "garbled" for _, labels in samples)


def test_a_workers_snapshot_is_parsed_once_not_at_every_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    # each scrape parsed every worker's snapshot again, on the metrics thread holding the GIL: 2.6 s a scrape at
    # 1,024 workers, and each unauthenticated scraper more
    own = Metrics()
    snapshot = {"w1": b'# TYPE envfleet_sandboxes gauge\nenvfleet_sandboxes{state="idle"} 3\n'}
    parses: list[str] = []
    real = text_string_to_metric_families

    def counted(text: str) -> Any:
        parses.append(text)
        return real(text)

    monkeypatch.setattr(worker_metrics, "text_string_to_metric_families", counted)
    scrape = fleet_registry(own.registry, lambda: [(w, "h", text) for w, text in snapshot.items()])

    def idle(worker: str) -> float | None:
        text = generate_latest(scrape).decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "envfleet_sandboxes" and s.labels.get("worker") == worker:
                    return float(s.value)
        return None

    assert [idle("w1") for _ in range(5)] == [3.0] * 5 and len(parses) == 1
    snapshot["w1"] = b'# TYPE envfleet_sandboxes gauge\nenvfleet_sandboxes{state="idle"} 4\n'  # its next heartbeat
    assert idle("w1") == 4.0 and len(parses) == 2
    snapshot["w2"] = snapshot.pop("w1")  # one worker gone, another come: the gone one's series go with it
    assert idle("w1") is None and idle("w2") == 4.0 and len(parses) == 3
