"""Rollout workers as Ray actors: join the trainer's Ray cluster and place `per_node` workers on every node that
advertises the sandbox-host resource (`envfleet_sandbox_host` by default). Ray gives placement, liveness and
restart; the data path stays envfleet's own (each actor dials the control plane's worker wire).

A node that joins later gets workers at the next poll. A node that dies takes its actors with it: their streams
end, and the hub retries their rollouts elsewhere as infrastructure retries. A worker whose run ended on a live node
(a crash) is replaced at the next poll; its first act, starting the Docker backend, sweeps what the dead one left.

With TLS on the worker wire, each actor gets the PEM material it needs (the CA it verifies the control plane by,
and for mTLS its own certificate and key) as bytes in its constructor arguments, like the worker token: no file has
to exist on the nodes, and Ray keeps these arguments as it keeps the token.

Ray is an optional extra (`pip install envfleet[ray]`): this module imports it only when a fleet starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.client.auth import ClientTLS
from orchestrator.worker.config import WorkerConfig

log = logging.getLogger(__name__)

ACTOR_STOP_S = 60.0


class RayConfig(BaseModel):
    """Where the Ray cluster is and how many workers each sandbox host gets."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field("auto", description="the cluster to join: auto, or HOST:PORT of its head")
    resource: str = Field("envfleet_sandbox_host", description="custom resource that marks a node as a sandbox host")
    per_node: int = Field(1, ge=1, le=256, description="worker actors per sandbox host (one per core is typical)")
    poll_s: float = Field(2.0, gt=0, le=300, description="how often to look for nodes that joined or died")
    namespace: str = "envfleet"


class _Worker:
    """The actor's body: one worker process's life, inside a Ray actor (defined as an actor at fleet start)."""

    def __init__(
        self, target: str, token: str, config_json: str, name: str, tls: ClientTLS | None = None, insecure: bool = False
    ) -> None:
        self._target, self._token, self._name = target, token, name
        self._tls, self._insecure = tls, insecure
        self._config = WorkerConfig.model_validate_json(config_json)
        self._stop = asyncio.Event()

    async def run(self) -> None:
        """Serve the control plane until stopped."""
        from orchestrator.worker.process import run_worker

        await run_worker(
            self._target, self._token, self._config, self._name, self._stop, tls=self._tls, insecure=self._insecure
        )

    async def stop(self) -> None:
        """Ask `run` to return (its sandboxes are destroyed on the way out)."""
        self._stop.set()


@dataclass
class _Placed:
    actor: Any
    run: Any  # the ObjectRef of its long-running `run` call
    node_id: str


@dataclass
class RayWorkers:
    """Worker actors on every sandbox-host node of a Ray cluster, kept in step with the cluster's nodes."""

    config: RayConfig
    target: str
    token: str
    worker: WorkerConfig
    tls: ClientTLS | None = None  # handed to every actor (None: plaintext, loopback or the operator's insecure)
    insecure: bool = False
    placed: dict[str, list[_Placed]] = field(default_factory=dict)  # node id -> its actors
    _watcher: asyncio.Task[None] | None = None
    _initialized_ray: bool = False
    _actor_class: Any = None
    replaced: int = 0  # actors started again after their run ended (a crash the actor did not survive)

    async def start(self) -> None:
        """Join the cluster, place workers on its sandbox hosts, and keep watching for nodes that come and go."""
        import ray

        if not ray.is_initialized():
            await asyncio.to_thread(
                ray.init, address=self.config.address, namespace=self.config.namespace, log_to_driver=False
            )
            self._initialized_ray = True
        await self.reconcile()
        self._watcher = asyncio.create_task(self._watch(), name="ray node watcher")

    def nodes(self) -> list[str]:
        """The sandbox-host nodes that have workers now."""
        return sorted(self.placed)

    async def reconcile(self) -> None:
        """Place workers on sandbox hosts that have none, replace workers whose run ended, forget dead nodes."""
        import ray

        nodes = await asyncio.to_thread(ray.nodes)
        alive = {n["NodeID"] for n in nodes if n["Alive"] and n.get("Resources", {}).get(self.config.resource, 0) > 0}
        for gone in set(self.placed) - alive:
            log.warning("ray node %s is gone; its workers' rollouts are retried elsewhere", gone[:12])
            del self.placed[gone]
        for node, placed in self.placed.items():
            ended, _ = await asyncio.to_thread(ray.wait, [p.run for p in placed], num_returns=len(placed), timeout=0)
            for i, p in enumerate(placed):
                if p.run in ended:
                    log.warning("a worker on ray node %s ended; starting another", node[:12])
                    with contextlib.suppress(Exception):
                        ray.kill(p.actor, no_restart=True)
                    placed[i] = self._place(node, i)
                    self.replaced += 1
        for node in sorted(alive - set(self.placed)):
            self.placed[node] = [self._place(node, i) for i in range(self.config.per_node)]
            log.info("placed %d worker(s) on ray node %s", self.config.per_node, node[:12])

    def _place(self, node: str, index: int) -> _Placed:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._actor_class is None:
            self._actor_class = ray.remote(max_restarts=0, num_cpus=0)(_Worker)
        actor = self._actor_class.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        ).remote(
            self.target, self.token, self.worker.model_dump_json(), f"ray-{node[:8]}-{index}", self.tls, self.insecure
        )
        return _Placed(actor, actor.run.remote(), node)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_s)
            try:
                await self.reconcile()
            except Exception:
                log.exception("looking at the ray cluster failed; trying again")

    async def stop(self) -> None:
        """Stop every worker actor (they destroy their sandboxes), then leave the cluster if we joined it."""
        import ray

        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        placed = [p for ps in self.placed.values() for p in ps]
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.get, [p.actor.stop.remote() for p in placed], timeout=10)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.wait, [p.run for p in placed], num_returns=len(placed), timeout=ACTOR_STOP_S)
        for p in placed:
            with contextlib.suppress(Exception):
                ray.kill(p.actor, no_restart=True)
        self.placed.clear()
        if self._initialized_ray:
            await asyncio.to_thread(ray.shutdown)
