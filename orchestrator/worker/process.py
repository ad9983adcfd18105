"""One worker's life: its backend, warm pool and executor, and the agent that serves a control plane until told to
stop. Used by `python -m orchestrator.worker` and by Ray actors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from orchestrator.backends.pool import SandboxPool
from orchestrator.client.auth import ClientTLS, check_client_transport
from orchestrator.core.metrics import Metrics
from orchestrator.core.private_dirs import sweep_private_dirs
from orchestrator.core.runtime import tune_gc
from orchestrator.core.stalls import StallWatch
from orchestrator.core.tracing import make_tracer
from orchestrator.rollout.runner import RolloutRunner
from orchestrator.rollout.snapshots import SnapshotBudget, SnapshotCache
from orchestrator.rollout.tito.tokenizer import TokenizerCache
from orchestrator.service.executor import LocalExecutor
from orchestrator.service.fleet import start_fleet
from orchestrator.service.registry import Registry
from orchestrator.worker.agent import WorkerAgent
from orchestrator.worker.config import WorkerConfig


async def run_worker(
    target: str,
    token: str,
    config: WorkerConfig,
    name: str,
    stop: asyncio.Event,
    *,
    on_agent: Callable[[WorkerAgent], None] | None = None,
    tls: ClientTLS | None = None,
    insecure: bool = False,
) -> None:
    """Serve the control plane at `target` until `stop` is set; every sandbox is destroyed on the way out. Over TCP
    `tls` says whom to trust (and what to present, for mTLS); the token is never sent in clear off loopback unless
    `insecure`. `on_agent` is handed the agent once it exists (a Ray actor reports on it)."""
    check_client_transport(target, token, tls, insecure)  # before any sandbox exists
    registry = Registry.from_entry_points()
    for reference in config.environments:  # a module missing on this host fails here, before any sandbox
        registry.load(reference)
    await asyncio.to_thread(sweep_private_dirs)  # what killed workers of this host left (a Ray node has no other)
    # each part is closed on the way out, in the reverse order, also when a later part fails to start: the backend's
    # sweeper and the pool's refills went on for as long as the process lived (a Ray actor's: until it was killed)
    async with contextlib.AsyncExitStack() as parts:
        tracer = make_tracer(config.tracing, "envfleet-worker")  # each worker process exports its own spans
        parts.push_async_callback(asyncio.to_thread, tracer.shutdown)  # the last spans go before the process ends
        fleet = await start_fleet(config.backend)
        parts.push_async_callback(fleet.backend.close)
        metrics = Metrics()  # its own: the control plane serves them, labelled with this worker, from the heartbeats
        fleet.export_metrics(metrics)
        pool = SandboxPool(fleet.backend, config.pool, metrics, max_sandboxes=config.slots)
        pool.start()
        parts.push_async_callback(pool.close)
        runner = RolloutRunner(pool, fleet.images, tracer, SnapshotCache(SnapshotBudget().shared_by(config.host_share)))
        executor = LocalExecutor(runner, TokenizerCache(config.tokenizer_dirs))
        parts.push_async_callback(executor.close)
        agent = WorkerAgent(
            target,
            token,
            executor,
            registry,
            name=name,
            slots=config.slots,
            heartbeat_s=config.heartbeat_s,
            orphan_after_s=config.orphan_after_s,
            metrics=metrics.registry,
            metrics_s=config.metrics_s,
            tls=tls,
            insecure=insecure,
            engine_wait_s=fleet.backend.outage_wait_s,
            engine_answering=fleet.backend.engine_answering,
            engine_waits=lambda: runner.engine_waits,
            host=config.host,
        )
        if on_agent is not None:
            on_agent(agent)
        stalls = StallWatch(f"worker {name}")
        stalls.start()
        parts.push_async_callback(stalls.stop)
        tune_gc()
        await agent.run_forever(stop)
