"""Rollout workers as Ray actors: join the trainer's Ray cluster and place `per_node` workers on every node that
advertises the sandbox-host resource (`envfleet_sandbox_host` by default). Ray gives placement, liveness and
restart; the data path stays envfleet's own (each actor dials the control plane's worker wire).

A node that joins later gets workers at the next poll. A node that dies takes its actors with it: their streams
end, and the hub retries their rollouts elsewhere as infrastructure retries. A worker whose run ended on a live node
(a crash) is replaced at the next poll, after a pause that grows while its slot's actors keep ending soon; its first
act, starting the Docker backend, sweeps what the dead one left. One whose worker the hub has not heard for
ACTOR_SILENT_S (stopped, hung, cut off: its run never ends) is killed and replaced the same way.

The actors are detached and named after the fleet (the data dir's fleet id), the node and their index, so they
outlive a control plane that crashes: they redial its fixed address with backoff, and the restarted control plane
finds them by name instead of placing more. An actor started with another address, token or configuration is
replaced. A normal stop kills every actor of the fleet.

With TLS on the worker wire, each actor gets the PEM material it needs (the CA it verifies the control plane by,
and for mTLS its own certificate and key) as bytes in its constructor arguments, like the worker token: no file has
to exist on the nodes, and Ray keeps these arguments as it keeps the token.

Ray is an optional extra (`pip install envfleet[ray]`): this module imports it only when a fleet starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.client.auth import ClientTLS
from orchestrator.core.errors import ConfigError
from orchestrator.core.net import is_loopback
from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.release import release

log = logging.getLogger(__name__)

ACTOR_STOP_S = 60.0
HEAD_CONNECT_S = 10.0  # how long the cluster's head has to accept a connection at the start
WILDCARDS = ("", "0.0.0.0", "::", "[::]")  # listen hosts that name every address of this host
ACTOR_ANSWER_S = 30.0  # an actor found by name that does not answer in this time is replaced
# an actor whose worker the hub has not heard this long is killed and replaced: stopped, hung or partitioned, its
# run never ends, so it held its sandboxes and its place for good (one that never joined gets ACTOR_JOIN_S)
ACTOR_SILENT_S = 60.0
ACTOR_JOIN_S = 300.0
# a slot whose actors keep ending soon after their start is placed again after a pause that doubles up to this
# (a bad --env module on a node: each new actor swept the engine, warmed sandboxes and failed, every poll)
REPLACE_BACKOFF_MAX_S = 60.0
STEADY_RUN_S = 60.0  # an actor that ran this long before it ended starts its slot's pause over
PLACE_AT_ONCE = 16  # placements (each a blocking thread) a reconcile runs side by side
WATCH_BACKOFF_MAX_S = 60.0  # the longest pause between looks at a cluster that keeps failing to answer
# the resources Ray gives every node itself: not what a sandbox host advertises
_RAY_OWN = {"CPU", "GPU", "memory", "object_store_memory", "accelerator_type"}


class RayConfig(BaseModel):
    """Where the Ray cluster is and how many workers each sandbox host gets."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field("auto", description="the cluster to join: auto, or HOST:PORT of its head")
    resource: str = Field(
        "envfleet_sandbox_host",
        pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
        description="custom resource that marks a node as a sandbox host",
    )
    per_node: int = Field(1, ge=1, le=256, description="worker actors per sandbox host (one per core is typical)")
    poll_s: float = Field(2.0, gt=0, le=300, description="how often to look for nodes that joined or died")
    namespace: str = Field(
        "envfleet", pattern=r"^[A-Za-z0-9_.:-]{1,128}$", description="the Ray namespace of the worker actors"
    )
    orphan_after_s: float = Field(
        3600.0,
        gt=0,
        description="a worker actor with no control plane for this long ends itself: detached, it outlives a control "
        "plane that crashes (the next one on the same data directory adopts it), and one that never comes back on "
        "it left the actor dialing for good",
    )


def actor_prefix(fleet_id: str) -> str:
    """What the names of a fleet's worker actors start with."""
    return f"envfleet-worker-{fleet_id}-"


def actor_name(fleet_id: str, node_id: str, index: int) -> str:
    """The name of a fleet's `index`th worker actor on a node: the same after a control-plane restart."""
    return f"{actor_prefix(fleet_id)}{node_id}-{index}"


class _Worker:
    """The actor's body: one worker process's life, inside a Ray actor (defined as an actor at fleet start)."""

    def __init__(
        self,
        target: str,
        token: str,
        config_json: str,
        name: str,
        fingerprint: str,
        tls: ClientTLS | None = None,
        insecure: bool = False,
    ) -> None:
        self._target, self._token, self._name, self._fingerprint = target, token, name, fingerprint
        self._tls, self._insecure = tls, insecure
        self._config = WorkerConfig.model_validate_json(config_json)
        self._stop = asyncio.Event()
        self._running: asyncio.Task[None] | None = None
        self._agent: Any = None

    async def run(self) -> None:
        """Serve the control plane until stopped. A later call (a restarted control plane watching this actor)
        waits for the same run."""
        from orchestrator.worker.process import run_worker

        if self._running is None:
            self._running = asyncio.create_task(
                run_worker(
                    self._target,
                    self._token,
                    self._config,
                    self._name,
                    self._stop,
                    on_agent=self._set_agent,
                    tls=self._tls,
                    insecure=self._insecure,
                )
            )
        try:
            await asyncio.shield(self._running)  # a caller that goes away does not end the run
        finally:
            # orphaned (WorkerConfig.orphan_after_s), or its run failed: the detached actor ends too, else it lived
            # on for good with its name once its control plane was gone
            if self._running.done() and not self._stop.is_set():
                import ray

                ray.actor.exit_actor()  # type: ignore[no-untyped-call]

    def _set_agent(self, agent: Any) -> None:
        self._agent = agent

    async def fingerprint(self) -> str:
        """What this actor was started with (address, token, configuration), hashed."""
        return self._fingerprint

    async def info(self) -> dict[str, int]:
        """Its process id and how many streams to a control plane it has opened so far."""
        return {"pid": os.getpid(), "sessions": self._agent.sessions if self._agent is not None else 0}

    async def stop(self) -> None:
        """Ask `run` to return (its sandboxes are destroyed on the way out)."""
        self._stop.set()


@dataclass
class _Placed:
    actor: Any
    run: Any  # the ObjectRef of its long-running `run` call
    node_id: str
    name: str
    worker_name: str  # its worker's name: the hub's worker ids of it start with it
    placed_at: float = field(default_factory=time.monotonic)
    heard: bool = False  # its worker has been connected to the hub
    unheard_since: float = field(default_factory=time.monotonic)

    def ran_s(self, now: float) -> float:
        """How long it ran as a worker: none when its worker never joined (a wrong CA, a firewall, a target it
        cannot reach), however long it lived; its 300 s until it was given up on counted as a steady run, and the
        slot's next actor was placed at once, every 5 minutes for good."""
        return now - self.placed_at if self.heard else 0.0


@dataclass
class RayWorkers:
    """Worker actors on every sandbox-host node of a Ray cluster, kept in step with the cluster's nodes."""

    config: RayConfig
    target: str
    token: str
    worker: WorkerConfig
    fleet_id: str
    placed: dict[str, dict[int, _Placed]] = field(default_factory=dict)  # node id -> worker index -> its actor
    tls: ClientTLS | None = None  # handed to every actor (None: plaintext, loopback or the operator's insecure)
    insecure: bool = False
    _watcher: asyncio.Task[None] | None = None
    _initialized_ray: bool = False
    _actor_class: Any = None
    replaced: int = 0  # actors started again after their run ended (a crash the actor did not survive)
    adopted: int = 0  # actors of this fleet found running at start (they outlived the last control plane)
    # the hub's connected worker ids (the plane sets it): an actor whose worker is not among them for
    # silent_s is killed and replaced; None: not watched
    connected: Callable[[], Collection[str]] | None = None
    silent_s: float = ACTOR_SILENT_S
    join_s: float = ACTOR_JOIN_S
    _not_before: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # slot -> (when, pause)
    _unreachable: set[str] = field(default_factory=set)  # nodes told they get no workers (a loopback target)
    _said_no_host: bool = False  # that no live node advertises the resource (_say_if_no_host)
    _placer: concurrent.futures.ThreadPoolExecutor | None = None  # the placements' threads (reconcile)
    _local: set[str] | None = None  # this machine's addresses as Ray knows it

    async def start(self) -> None:
        """Join the cluster, find or place workers on its sandbox hosts, and keep watching for nodes that come and
        go."""
        try:
            import ray
        except ImportError:
            raise ConfigError("--ray-address needs Ray on this host: pip install 'envfleet[ray]'") from None
        if not ray.is_initialized():
            await _head_answers(self.config.address)
            try:
                await asyncio.to_thread(
                    ray.init, address=self.config.address, namespace=self.config.namespace, log_to_driver=False
                )
            except (ConnectionError, ValueError, RuntimeError) as e:  # no cluster there, or one of another Ray
                raise ConfigError(f"cannot join the Ray cluster at {self.config.address!r}: {e}") from None
            self._initialized_ray = True
        host, _, port = self.target.rpartition(":")
        if host in WILDCARDS:
            # a listen address is no address to dial: on another node 0.0.0.0 is that node. This node's address as
            # the cluster knows it is what the other nodes reach it by
            ip = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
            self.target = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            log.info("worker actors dial this control plane at %s (--worker-listen %s:%s)", self.target, host, port)
        await self.reconcile()
        await asyncio.to_thread(self._retire_strays)
        self._watcher = asyncio.create_task(self._watch(), name="ray node watcher")

    def _reaches(self, node: dict[str, Any]) -> bool:
        """Whether a worker on `node` can dial the target. A loopback target (--worker-listen 127.0.0.1:P) is this
        machine's alone: on a node of another machine its actor dialed that machine's own loopback, and sent the
        worker token in clear to whatever listened there. Such a node gets no workers (said once)."""
        host = self.target.rpartition(":")[0].strip("[]")
        if not is_loopback(host) or node.get("NodeManagerAddress") in self._local_ips():
            return True
        if node["NodeID"] not in self._unreachable:
            self._unreachable.add(node["NodeID"])
            log.error(
                "ray node %s (%s) gets no workers: this control plane listens for workers on loopback (%s), which "
                "only its own machine reaches; give --worker-listen an address the nodes reach (with TLS)",
                node["NodeID"][:12],
                node.get("NodeManagerAddress"),
                self.target,
            )
        return False

    def _local_ips(self) -> set[str]:
        import ray

        if self._local is None:
            self._local = {str(ray.util.get_node_ip_address()), "127.0.0.1", "::1"}  # type: ignore[no-untyped-call]
        return self._local

    def nodes(self) -> list[str]:
        """The sandbox-host nodes that have workers now."""
        return sorted(node for node, placed in self.placed.items() if placed)

    def _fingerprint(self, name: str) -> str:
        tls = self.tls or ClientTLS()
        pems = (tls.root_certificates, tls.certificate_chain, tls.private_key)
        # and this build: an actor of the build before an upgrade is refused at its hello, so it is replaced at once
        parts = (self.target, self.token, self.worker.model_dump_json(), name, str(self.insecure), release())
        h = hashlib.sha256("\0".join(parts).encode())
        for pem in pems:  # new TLS material means a new actor too
            h.update(b"\0" + hashlib.sha256(pem or b"").digest())
        return h.hexdigest()

    async def reconcile(self) -> None:
        """Place workers on sandbox hosts that have none, replace workers whose run ended, forget dead nodes."""
        import ray

        nodes = await asyncio.to_thread(ray.nodes)
        hosts = [n for n in nodes if n["Alive"] and n.get("Resources", {}).get(self.config.resource, 0) > 0]
        self._say_if_no_host(nodes, bool(hosts))
        alive = {n["NodeID"] for n in hosts if self._reaches(n)}
        for gone in set(self.placed) - alive:
            log.warning("ray node %s is gone; its workers' rollouts are retried elsewhere", gone[:12])
            del self.placed[gone]
        # and what was kept of nodes gone from the cluster: in an autoscaled fleet, node ids come and go for good
        known = {n["NodeID"] for n in nodes if n["Alive"]}
        self._unreachable &= known
        for slot in [slot for slot in self._not_before if slot[0] not in known]:
            del self._not_before[slot]
        now = time.monotonic()
        names = self._connected_names()
        for node, placed in self.placed.items():
            if not placed:
                continue
            runs = [p.run for p in placed.values()]
            ended, _ = await asyncio.to_thread(ray.wait, runs, num_returns=len(runs), timeout=0)
            for index, p in list(placed.items()):
                if p.run in ended:
                    why = await asyncio.to_thread(_outcome, p.run)
                    log.warning("the worker %s on ray node %s ended (%s); starting another", p.name, node[:12], why)
                elif self._silent(p, now, names):
                    log.error(
                        "the worker %s on ray node %s has not been connected for %gs (stopped, hung or cut off); "
                        "killing it and starting another",
                        p.name,
                        node[:12],
                        now - p.unheard_since,
                    )
                else:
                    continue
                with contextlib.suppress(Exception):  # a call to the cluster's head: off the loop, like the rest
                    await asyncio.to_thread(ray.kill, p.actor, no_restart=True)
                del placed[index]  # its name is free once it is dead: placed again at once or at the next poll
                self.replaced += 1
                self._pause((node, index), p.ran_s(now), now)
        # side by side: each placement waits on the cluster (an actor's start, or a stale one's whole teardown), and
        # one after another a restart with a new configuration kept the API down for an hour on 100 nodes of 8
        slots = [
            (node, index)
            for node in sorted(alive)
            for index in range(self.config.per_node)
            if index not in self.placed.setdefault(node, {})
            and self._not_before.get((node, index), (0.0, 0.0))[0] <= now
        ]
        if self._placer is None:  # threads of its own: the default executor's few serve every other call
            self._placer = concurrent.futures.ThreadPoolExecutor(PLACE_AT_ONCE, thread_name_prefix="ray-place")
        loop = asyncio.get_running_loop()

        async def place(node: str, index: int) -> None:
            new = await loop.run_in_executor(self._placer, self._place, node, index)
            if new is not None and node in self.placed:
                self.placed[node][index] = new

        await asyncio.gather(*(place(node, index) for node, index in slots))
        for node in sorted({node for node, _ in slots}):
            placed = self.placed.get(node, {})
            log.info("%d of %d worker(s) on ray node %s", len(placed), self.config.per_node, node[:12])

    def _connected_names(self) -> set[str] | None:
        """Every worker name a connected worker's id starts with (the id up to each of its dashes), read once a poll:
        each actor asked the hub for every worker and scanned them, 3.6 s of the loop a poll at 1,024 actors and
        50 s at 4,096; None: not watched."""
        if self.connected is None:
            return None
        names: set[str] = set()
        for worker_id in self.connected():
            dash = worker_id.find("-")
            while dash != -1:
                names.add(worker_id[:dash])
                dash = worker_id.find("-", dash + 1)
        return names

    def _silent(self, p: _Placed, now: float, names: set[str] | None) -> bool:
        """Whether the actor's worker has been away from the hub too long (it joined, then went silent: silent_s;
        it never joined: join_s); `names`: _connected_names()."""
        if names is None:
            return False
        if p.worker_name in names:
            p.heard, p.unheard_since = True, now
            return False
        return now - p.unheard_since > (self.silent_s if p.heard else self.join_s)

    def _pause(self, slot: tuple[str, int], ran_s: float, now: float) -> None:
        """The slot's next actor waits a pause that doubles while its actors end soon after they start."""
        pause = (
            0.0
            if ran_s >= STEADY_RUN_S
            else min(max(1.0, 2 * self._not_before.get(slot, (0.0, 0.0))[1]), REPLACE_BACKOFF_MAX_S)
        )
        self._not_before[slot] = (now + pause, pause)

    def _place(self, node: str, index: int) -> _Placed | None:
        """The node's `index`th worker: the live actor of that name if it was started as this control plane would
        start it (it outlived the last one), else a new actor. None when the name is still held by an actor being
        replaced (blocking: called in a thread)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name = actor_name(self.fleet_id, node, index)
        fingerprint = self._fingerprint(name)
        existing = _find(name, self.config.namespace)
        if existing is not None:
            try:
                theirs = ray.get(existing.fingerprint.remote(), timeout=ACTOR_ANSWER_S)
            except Exception as e:  # dead, dying, or not answering
                log.warning("worker actor %s does not answer (%s); replacing it", name, type(e).__name__)
                theirs = None
            if theirs == fingerprint:
                log.info("worker actor %s outlived the last control plane; it reconnects", name)
                self.adopted += 1
                return _Placed(existing, existing.run.remote(), node, name, worker_name(node, index))
            log.warning("worker actor %s was started with another address, token or config; replacing it", name)
            _retire(existing)
            return None
        if self._actor_class is None:
            self._actor_class = ray.remote(max_restarts=0, num_cpus=0)(_Worker)
        try:
            actor = self._actor_class.options(
                name=name,
                namespace=self.config.namespace,
                lifetime="detached",  # outlives a control plane that crashes; a normal stop kills it
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            ).remote(
                self.target,
                self.token,
                self.worker.model_dump_json(),
                worker_name(node, index),
                fingerprint,
                self.tls,
                self.insecure,
            )
        except ValueError as e:  # the name is taken: the actor that held it is still being killed
            log.info("worker actor %s: %s; trying again at the next poll", name, e)
            return None
        return _Placed(actor, actor.run.remote(), node, name, worker_name(node, index))

    def _retire_strays(self, skip: frozenset[str] = frozenset(), *, at_once: bool = False) -> None:
        """Stop actors of this fleet that no node's plan has (fewer per node than before, a node no longer a
        sandbox host), but those named in `skip` (blocking); `at_once`: kill them without waiting for their
        teardown (their sandboxes are the sweep's)."""
        import ray

        wanted = {p.name for placed in self.placed.values() for p in placed.values()} | skip
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name, namespace = entry["name"], entry["namespace"]
            ours = namespace == self.config.namespace and name.startswith(actor_prefix(self.fleet_id))
            if ours and name not in wanted and (actor := _find(name, namespace)) is not None:
                log.info("stopping worker actor %s: no longer wanted", name)
                if at_once:
                    with contextlib.suppress(Exception):
                        ray.kill(actor, no_restart=True)
                else:
                    _retire(actor)

    def _say_if_no_host(self, nodes: list[dict[str, Any]], any_host: bool) -> None:
        """Say once (again after one came and went) that no live node advertises the resource: a name mistyped
        placed no worker at all, and the jobs' rollouts waited for one in silence."""
        if any_host:
            self._said_no_host = False
            return
        if self._said_no_host:
            return
        self._said_no_host = True
        seen = sorted({r for n in nodes if n["Alive"] for r in n.get("Resources", {}) if r not in _RAY_OWN})
        log.error(
            "no live ray node advertises the resource %r, so no worker is placed: start sandbox hosts with "
            "`ray start --resources '{\"%s\": 1}'` (custom resources the nodes advertise: %s)",
            self.config.resource,
            self.config.resource,
            ", ".join(seen) or "none",
        )

    async def _watch(self) -> None:
        failures = 0
        while True:
            # a cluster that does not answer is asked less often, up to a minute apart, and said once a failure
            await asyncio.sleep(min(self.config.poll_s * 2**failures, max(self.config.poll_s, WATCH_BACKOFF_MAX_S)))
            try:
                await self.reconcile()
                failures = 0
            except Exception as e:
                if not failures:
                    log.exception("looking at the ray cluster failed; trying again")
                else:
                    log.warning("looking at the ray cluster failed again (%d in a row): %s", failures + 1, e)
                failures = min(failures + 1, 16)

    async def stop(self) -> None:
        """Stop every worker actor of the fleet (they destroy their sandboxes), then leave the cluster if we joined
        it."""
        import ray

        if not ray.is_initialized():
            return  # never joined (its start failed): any call below would start a Ray of its own on this host
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        placed = [p for ps in self.placed.values() for p in ps.values()]
        cut = False
        try:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(ray.get, [p.actor.stop.remote() for p in placed], timeout=10)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(
                    ray.wait, [p.run for p in placed], num_returns=len(placed), timeout=ACTOR_STOP_S
                )
        except asyncio.CancelledError:
            cut = True
            raise
        finally:
            # also when the shutdown's budget ran out meanwhile (this was cancelled): a detached actor left alive
            # would hold its sandboxes until a control plane of the fleet came back (for orphan_after_s); a killed
            # one's are swept
            for p in placed:
                with contextlib.suppress(Exception):
                    ray.kill(p.actor, no_restart=True)
            self.placed.clear()
            if cut:  # and any other of the fleet's (one a placement made as we stopped): killed too, not waited for
                with contextlib.suppress(Exception):
                    self._retire_strays(frozenset(p.name for p in placed), at_once=True)
        with contextlib.suppress(Exception):  # any other of the fleet's actors (one being placed as we stopped)
            await asyncio.to_thread(self._retire_strays, frozenset(p.name for p in placed))
        if self._placer is not None:
            self._placer.shutdown(wait=False)
        if self._initialized_ray:
            await asyncio.to_thread(ray.shutdown)


async def _head_answers(address: str) -> None:
    """ConfigError unless something accepts a connection at `address` (HOST:PORT; `auto` and ray:// ones are
    Ray's to find): ray.init retried one that nothing answers for minutes, saying nothing."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        async with asyncio.timeout(HEAD_CONNECT_S):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except (OSError, TimeoutError) as e:
        raise ConfigError(
            f"cannot join the Ray cluster at {address!r}: nothing answers there ({e or 'no answer'}); give the head's "
            "GCS address (`ray start --head` prints it), or auto on one of the cluster's nodes"
        ) from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def worker_name(node_id: str, index: int) -> str:
    """The worker name of a node's `index`th actor (its hub worker id starts with it)."""
    return f"ray-{node_id[:8]}-{index}"


def _outcome(run: Any) -> str:
    """Why an actor's ended run ended, in a line (blocking)."""
    import ray

    try:
        ray.get(run, timeout=0)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
    return "it returned"


def _find(name: str, namespace: str) -> Any:
    """The live actor of that name, or None."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _retire(actor: Any) -> None:
    """Stop an actor (it destroys its sandboxes), then kill it (blocking)."""
    import ray

    with contextlib.suppress(Exception):
        ray.get(actor.stop.remote(), timeout=10)
        ray.wait([actor.run.remote()], timeout=ACTOR_STOP_S)  # a stopped run returns at once
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)
