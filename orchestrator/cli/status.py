"""`envfleet status`: the Prometheus metrics of a running orchestrator, as a terminal table."""

from __future__ import annotations

from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table

from orchestrator.client.auth import target_host

Samples = dict[str, list[tuple[dict[str, str], float]]]


def metrics_url(server: str, port: int) -> str:
    """The metrics page of the orchestrator at `server` (host:port): same host, the metrics port, plain HTTP."""
    host = target_host(server)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def fetch_status(url: str) -> Samples:
    """Every sample of the metrics page, by sample name (httpx.HTTPError when it cannot be read)."""
    response = httpx.get(url, timeout=10)
    response.raise_for_status()
    text = response.text
    out: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return out


def histogram_quantile(samples: Samples, name: str, q: float, labels: dict[str, str] | None = None) -> float | None:
    """The q-quantile from a histogram's cumulative buckets (upper bound of the bucket it falls in)."""
    buckets = [
        (float(lab["le"]), v)
        for lab, v in samples.get(f"{name}_bucket", [])
        if all(lab.get(k) == val for k, val in (labels or {}).items())
    ]
    if not buckets:
        return None
    merged: dict[float, float] = defaultdict(float)
    for le, v in buckets:
        merged[le] += v
    ordered = sorted(merged.items())
    total = ordered[-1][1]
    if total == 0:
        return None
    for le, v in ordered:
        if v >= q * total:
            return le
    return ordered[-1][0]


def _value(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def render_status(samples: Samples) -> Table:
    """One table: sandboxes, queue, rollouts by status, pools, latencies and engine errors."""
    t = Table(title="envfleet status", show_header=True)
    t.add_column("what")
    t.add_column("value", justify="right")
    # with rollout workers, each process (the control plane and every worker) has its own series: summed here
    for state in sorted({lab.get("state", "") for lab, _ in samples.get("envfleet_sandboxes", [])}):
        t.add_row(f"sandboxes {state}", f"{_value(samples, 'envfleet_sandboxes', state=state):g}")
    t.add_row("  of the idle, frozen", f"{_value(samples, 'envfleet_pool_frozen'):g}")
    t.add_row("rollouts in flight", f"{_value(samples, 'envfleet_rollouts_in_flight'):g}")
    t.add_row("queue depth", f"{_value(samples, 'envfleet_queue_depth'):g}")
    t.add_row("  of which waiting for an image", f"{_value(samples, 'envfleet_queue_waiting_for_images'):g}")
    wait = histogram_quantile(samples, "envfleet_queue_wait_seconds", 0.5)
    t.add_row("queue wait p50", "-" if wait is None else f"<= {wait:g} s")
    for lab, v in sorted(samples.get("envfleet_rollouts_total", []), key=lambda x: x[0].get("status", "")):
        t.add_row(f"rollouts {lab.get('status')}", f"{v:g}")
    for pool in sorted({lab.get("pool", "") for lab, _ in samples.get("envfleet_pool_idle", [])}):
        idle, target = (_value(samples, name, pool=pool) for name in ("envfleet_pool_idle", "envfleet_pool_target"))
        t.add_row(f"pool {pool} idle / target", f"{idle:g} / {target:g}")
    for reason in sorted({lab.get("reason", "") for lab, _ in samples.get("envfleet_pool_discards_total", [])}):
        t.add_row(f"pool discards ({reason})", f"{_value(samples, 'envfleet_pool_discards_total', reason=reason):g}")
    for source in ("warm", "cold"):
        p = histogram_quantile(samples, "envfleet_sandbox_acquire_seconds", 0.5, {"source": source})
        if p is not None:
            t.add_row(f"acquire p50 ({source})", f"<= {p * 1000:g} ms")
    for name, label in (
        ("envfleet_sandbox_create_seconds", "cold create p50"),
        ("envfleet_sandbox_reset_seconds", "reset p50"),
    ):
        p = histogram_quantile(samples, name, 0.5)
        if p is not None:
            t.add_row(label, f"<= {p * 1000:g} ms")
    t.add_row("engine errors", f"{_value(samples, 'envfleet_docker_api_errors_total'):g}")
    t.add_row(
        "engine calls in flight / limit (waiting)",
        f"{_value(samples, 'envfleet_docker_api_in_flight'):g} / {_value(samples, 'envfleet_docker_api_limit'):g}"
        f" ({_value(samples, 'envfleet_docker_api_waiting'):g})",
    )
    return t
