"""The viewer in a real headless Chromium: a live job on the fake backend with the scripted policy (token ids from
the toy tokenizer), its jobs page, rollouts table, one rollout's turns and mask-coloured tokens, a group with its
advantages; a screenshot at 1280x800; and a 100-turn rollout from a file."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.core.models import Rollout
from orchestrator.server.app import Orchestrator
from orchestrator.service.advantages import group_advantages
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import ScriptedServer, start_scripted_server
from orchestrator.testing.scripts import reference_script
from orchestrator.testing.synthetic_rollouts import long_rollout
from orchestrator.viewer.html import seg
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, serve
from tests.viewer.conftest import WINDOW, Browser, serve_file, write_jsonl


@pytest.fixture
async def policy() -> AsyncIterator[ScriptedServer]:
    server = await start_scripted_server(reference_script(Registry.from_entry_points().get(ENV)))
    yield server
    await server.close()


@pytest.fixture
async def orch(tmp_path: Path) -> AsyncIterator[Orchestrator]:
    async with serve(tmp_path / "data", backend=FAKE, ui_port=0) as o:
        yield o


async def _run_job(orch: Orchestrator, url: str, n: int = 2) -> tuple[str, list[Rollout]]:
    task_ids = [t.id for t in orch.jobs.registry.get(ENV).tasks()][:2]
    job_id, total = await orch.jobs.submit(job(url, task_ids, n=n))
    rollouts = [e.rollout() async for batch in orch.jobs.stream(job_id) for e in batch.entries]
    assert len(rollouts) == total == 2 * n
    return job_id, rollouts


def _rows(dom: str) -> list[str]:
    table = dom.split('id="rollouts"', 1)[1].split("</table>", 1)[0]
    return re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]  # the first row is the header


async def test_a_live_job_its_rollout_and_its_group_in_chromium(
    orch: Orchestrator, policy: ScriptedServer, browser: Browser, tmp_path: Path
) -> None:
    job_id, rollouts = await _run_job(orch, policy.url)
    assert orch.ui is not None
    base = orch.ui.url

    jobs = await browser.dom(base + "/")
    assert job_id in jobs and "COMPLETED" in jobs and "4/4" in jobs

    page = await browser.dom(f"{base}/job/{seg(job_id)}")
    assert len(_rows(page)) == 4
    assert 'id="throughput"' in page and "<rect" in page, "no throughput chart"
    by_status = page.split('id="by-status"', 1)[1].split("</table>", 1)[0]
    assert all(r.status.value in by_status for r in rollouts)

    # filter and sort server-side: the OK rollouts by reward, highest first
    ok = await browser.dom(f"{base}/job/{seg(job_id)}?status=OK&sort=reward&desc=1")
    expected_ok = sum(r.status.value == "OK" for r in rollouts)
    assert len(_rows(ok)) == expected_ok and "reward ▼" in ok

    r = next(x for x in rollouts if x.tokens.status == "complete")
    url = f"{base}/job/{seg(job_id)}/rollout/{seg(r.id)}"
    one = await browser.dom(url)
    assert one.count('class="card turn') == len(r.turns) >= 3
    assert "role-assistant" in one and "role-tool" in one
    for call in (c for t in r.turns for c in t.tool_calls):
        assert call.name in one
    # every completion token is one span, coloured by its mask, with its logprob on hover
    spans = re.findall(r'<span class="(m[01])(?: odd)?" title="([^"]*)">', one.split('id="tokens"', 1)[1])
    assert [int(cls[1]) for cls, _ in spans] == r.tokens.completion_mask
    assert {0, 1} <= set(r.tokens.completion_mask), "the scripted job should mix policy and observation tokens"
    first_policy = r.tokens.completion_mask.index(1)
    assert f"id {r.tokens.completion_ids[first_policy]} · policy · logprob " in spans[first_policy][1]
    assert f"{r.tokens.completion_logprobs[first_policy]:.4f}" in spans[first_policy][1]
    assert "odd" not in one.split('id="tokens"', 1)[1], "a correct mask is flagged as suspect"
    for phase in ("queue", "sandbox_acquire", "setup", "generation", "tools", "scoring"):
        assert f'class="p-{phase}"' in one

    shot = tmp_path / "rollout.png"
    assert await browser.screenshot(url, shot) == WINDOW
    assert shot.stat().st_size > 20_000, "the screenshot looks blank"

    group = await browser.dom(f"{base}/job/{seg(job_id)}/group/{seg(r.group_id)}")
    members = sorted((x for x in rollouts if x.group_id == r.group_id), key=lambda x: x.sample_index)
    shown = re.findall(r'advantage <b class="adv">([^<]*)</b>', group)
    want = group_advantages([x.reward for x in members], orch.jobs._jobs[job_id].spec.advantage)
    assert shown == [f"{a:.3f}" if a is not None else "\u2013" for a in want]


async def test_a_rollout_of_100_turns_renders_from_a_file(browser: Browser, tmp_path: Path) -> None:
    r = long_rollout(turns=100, tool_output="line\n" * 200)  # long tool outputs: folded
    with serve_file(write_jsonl(tmp_path / "long.jsonl", [r])) as viewer:
        dom = await browser.dom(f"{viewer.url}/job/{seg(r.job_id)}/rollout/{seg(r.id)}")
    assert dom.count('class="card turn') == len(r.turns) == 101
    tool_turns = dom.split('<div class="card turn role-tool"')[1:]
    assert len(tool_turns) == 50 and all("<details><summary>" in t.split("</div>", 1)[0] for t in tool_turns)
    assert "lines</summary>" in tool_turns[0] and "<details><summary>" not in dom.split("role-assistant", 2)[1]
    # `envfleet view` decodes the scripted policy's ids with the toy tokenizer: the text reads back
    tokens = dom.split('id="tokens"', 1)[1]
    assert '<span class="m1" title="#0 · id ' in tokens and ">S</span>" in tokens
