"""The live viewer over a server's result log."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from orchestrator.core.policy import REPLAY_URL
from orchestrator.viewer.html import seg
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, serve
from tests.viewer.test_security import get


@pytest.mark.parametrize("acked", ["keep", "slim"])
async def test_a_slimmed_rollouts_page_says_its_turns_were_not_kept(
    tmp_path: Path, acked: Literal["keep", "slim"]
) -> None:
    # a slim log drops an acked rollout's turns and tokens: its page showed "0 turns" and an empty episode, no word why
    async with serve(tmp_path / "data", backend=FAKE, ui_port=0, result_log_acked=acked) as orch:
        assert orch.ui is not None
        task_id = next(iter(orch.jobs.registry.get(ENV).tasks())).id
        job_id, _ = await orch.jobs.submit(job(REPLAY_URL, [task_id]))
        (entry,) = [e async for batch in orch.jobs.stream(job_id) for e in batch.entries]
        rollout = entry.rollout()
        assert rollout.turns
        await orch.jobs.ack(job_id, entry.seq, [])
        status, _, page = await get(orch.ui.url, f"/job/{seg(job_id)}/rollout/{seg(rollout.id)}")
    assert status == 200
    if acked == "slim":
        assert 'id="slim"' in page and "turns not kept" in page and 'id="turns"' not in page, page[-1500:]
    else:
        assert 'id="slim"' not in page and f"{len(rollout.turns)} turns" in page and 'id="turns"' in page
