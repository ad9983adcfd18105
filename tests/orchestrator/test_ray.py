"""Workers on a real Ray cluster (a head and two sandbox-host nodes on this machine, on loopback, sharing its
Docker engine): both nodes serve rollouts; a node removed mid-job loses nothing and leaves no sandbox behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from orchestrator.backends.docker.config import DockerBackendConfig
from orchestrator.backends.docker.sweeper import LABEL_MANAGED, LABEL_OWNER
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import RolloutStatus
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.testing.scripted_policy import ScriptedServer
from orchestrator.worker.ray_fleet import RayConfig
from tests.conftest import TEST_OWNER
from tests.orchestrator.conftest import job
from tests.orchestrator.servers import check_delivery

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")
RESOURCE = "envfleet_sandbox_host"


@pytest.fixture
def cluster() -> Iterator[Any]:
    c = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(2):
            c.add_node(num_cpus=1, resources={RESOURCE: 1})
        yield c
    finally:
        c.shutdown()


@pytest.fixture
async def ray_plane(tmp_path: Path, base_image: str, cluster: Any) -> AsyncIterator[Orchestrator]:
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path / "data",
            backend=DockerBackendConfig(owner=TEST_OWNER),
            worker_listen="127.0.0.1:0",
            worker_heartbeat_timeout_s=5.0,
            ray=RayConfig(address=cluster.address, resource=RESOURCE, poll_s=1.0),
        )
    )
    try:
        assert orch.workers is not None and orch.workers.ray is not None
        await orch.workers.hub.wait_for_workers(2, timeout_s=240)
        yield orch
    finally:
        await orch.stop(grace=1)
    left = docker.from_env().containers.list(
        all=True, filters={"label": [f"{LABEL_MANAGED}=1", f"{LABEL_OWNER}={TEST_OWNER}"]}
    )
    assert not left, f"sandboxes left behind: {[c.name for c in left]}"


async def test_a_job_across_two_ray_nodes_survives_losing_one(
    ray_plane: Orchestrator,
    cluster: Any,
    slow_policy: ScriptedServer,
    task_ids: list[str],
) -> None:
    assert ray_plane.workers is not None and ray_plane.workers.ray is not None
    fleet, hub = ray_plane.workers.ray, ray_plane.workers.hub
    assert len(fleet.nodes()) == 2
    async with EnvfleetClient(ray_plane.address) as client:
        job_id = await client.submit(job(slow_policy.url, task_ids[:32], max_concurrency=8))
        for _ in range(1200):
            if len([w for w in hub.workers() if w.served > 0]) == 2:
                break
            await asyncio.sleep(0.1)
        served = {w.worker_id: w.served for w in hub.workers()}
        assert len(served) == 2 and all(served.values()), f"both nodes serve rollouts: {served}"
        # remove the node of one worker (its raylet and its actors die with it)
        victim_node = next(n for n in cluster.worker_nodes if n.node_id in fleet.nodes())
        cluster.remove_node(victim_node)
        rollouts = [r async for r in client.rollouts(job_id)]
        info = await client.get_job(job_id)
    check_delivery(rollouts, {f"{job_id}:{t}:0" for t in task_ids[:32]})
    assert info.by_status.get(RolloutStatus.OK, 0) == 32, info.by_status
    assert hub.lost >= 1
    for _ in range(100):  # the watcher forgets the dead node
        if len(fleet.nodes()) == 1:
            break
        await asyncio.sleep(0.1)
    assert len(fleet.nodes()) == 1
