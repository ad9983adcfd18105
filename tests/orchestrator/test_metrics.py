"""The Prometheus endpoint and `envfleet status` against a live orchestrator."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.backends.docker.backend import DockerBackendConfig
from orchestrator.cli.status import Samples, histogram_quantile
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.metrics import Metrics
from orchestrator.core.models import JobState
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.testing.scripted_policy import ScriptedServer
from tests.conftest import REPO, TEST_OWNER
from tests.orchestrator.conftest import job


async def test_metrics_endpoint_and_status(
    tmp_path: Path, base_image: str, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    orch = await create_server(
        OrchestratorConfig(port=0, data_dir=tmp_path, backend=DockerBackendConfig(owner=TEST_OWNER), metrics_port=0)
    )
    try:
        async with EnvfleetClient(orch.address) as c:
            got = [r async for r in c.rollouts(await c.submit(job(policy_server.url, task_ids[:3])))]
        assert len(got) == 3
        url = f"http://127.0.0.1:{orch.metrics_port}/metrics"
        async with httpx.AsyncClient() as h:
            text = (await h.get(url)).text
        assert 'envfleet_rollouts_total{status="OK"} 3.0' in text
        assert 'envfleet_sandbox_acquire_seconds_count{source="cold"}' in text
        assert "envfleet_sandbox_create_seconds_bucket" in text
        count = "envfleet_tool_exec_seconds_count "
        tool_calls = [float(x.removeprefix(count)) for x in text.splitlines() if x.startswith(count)]
        assert tool_calls and tool_calls[0] >= 3, tool_calls  # each rollout called a tool, submit at least
        assert "envfleet_queue_depth 0.0" in text and "envfleet_queue_waiting_for_images 0.0" in text
        assert "envfleet_docker_api_limit 16.0" in text  # api_workers: a healthy engine never had it cut
        assert "envfleet_docker_api_waiting 0.0" in text and "envfleet_docker_engine_answering 1.0" in text
        assert 'envfleet_sandboxes{state="idle"}' in text  # python-tool recycles: its sandboxes wait warm
        r = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "orchestrator.cli", "status", "--metrics", url, "--server", orch.address],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert "rollouts OK" in r.stdout and "queue depth" in r.stdout and "acquire p50 (cold)" in r.stdout
        assert "waiting for an image" in r.stdout and "engine calls in flight / limit" in r.stdout
    finally:
        await orch.stop()


async def test_a_scrape_while_the_loop_changes_what_the_gauges_count_never_fails(
    fake_orchestrator: Orchestrator,
) -> None:
    # the job, queue and pool gauges are read at a scrape, on the metrics server's thread, while the event loop adds
    # and removes jobs, queues and pools: a read that iterated a dict live raised "dictionary changed size during
    # iteration", and prometheus_client answered the whole page with a 500
    orch = fake_orchestrator
    assert orch.metrics is not None and orch.pool is not None
    jobs: dict[Any, Any] = orch.jobs._jobs
    queues: dict[Any, Any] = orch.jobs.scheduler._queues
    pools: dict[Any, Any] = orch.pool._pools
    stop, failures, scrapes = threading.Event(), [], [0]

    def scrape() -> None:
        while not stop.is_set():
            try:
                generate_latest(orch.metrics.registry)  # type: ignore[union-attr]
                scrapes[0] += 1
            except RuntimeError as e:
                failures.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        end = time.monotonic() + 2
        i = 0
        while time.monotonic() < end:  # the loop's own thread, blocked here: only the scraper runs beside it
            key = f"k{i % 64}"
            for d, value in (
                (jobs, SimpleNamespace(state=JobState.RUNNING)),
                (queues, SimpleNamespace(pending=[], ready=True)),
                (pools, SimpleNamespace(idle=[])),
            ):
                if key in d:
                    del d[key]
                else:
                    d[key] = value
            i += 1
    finally:
        stop.set()
        scraper.join()
        sys.setswitchinterval(switch)
        for d in (jobs, queues, pools):
            for k in [k for k in d if str(k).startswith("k")]:
                del d[k]
    assert scrapes[0] > 10 and not failures, (scrapes[0], failures[:1])


def test_waits_and_calls_past_a_minute_land_in_buckets_not_in_inf() -> None:
    # a queue wait, a tool call at its timeout, a cold create of a large image: past 60 s, the last bound, each was
    # +Inf, and `envfleet status` showed a p50 of inf
    metrics = Metrics()
    for seconds in (5, 90, 300, 1200, 3000):
        metrics.queue_wait_seconds.observe(seconds)
        metrics.exec_seconds.observe(seconds)
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            samples[s.name].append((dict(s.labels), float(s.value)))
    for name in ("envfleet_queue_wait_seconds", "envfleet_tool_exec_seconds"):
        assert histogram_quantile(samples, name, 0.5) == 300, name
        assert histogram_quantile(samples, name, 0.99) == 3600, name


async def test_a_sessions_sandbox_is_in_the_held_gauge(tmp_path: Path) -> None:
    # made outside the pool, a session's or a raw sandbox's took the host's capacity in no sandbox gauge at all
    from orchestrator.backends.config import FakeBackendConfig
    from protos import orchestrator_pb2 as pb

    orch = await create_server(
        OrchestratorConfig(port=0, data_dir=tmp_path, backend=FakeBackendConfig(owner=TEST_OWNER))
    )
    try:
        metrics = orch.metrics
        assert metrics is not None
        assert "envfleet_sandboxes_held 0.0" in metrics.render().decode()
        async with EnvfleetClient(orch.address) as c:
            r = await c.session_stub.Reset(pb.ResetRequest(env="python-tool", task_id="py-000"))
            assert "envfleet_sandboxes_held 1.0" in metrics.render().decode()
            await c.session_stub.CloseSession(pb.CloseSessionRequest(session_id=r.session_id))
        assert "envfleet_sandboxes_held 0.0" in metrics.render().decode()
    finally:
        await orch.stop()
