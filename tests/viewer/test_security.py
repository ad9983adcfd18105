"""The viewer's threat model: rollout text is hostile (escaped, and the pages forbid scripts), it is read-only, it
authenticates like the API (bearer token or the login cookie), a tenant sees only its own jobs, and without tokens
it answers loopback names only."""

from __future__ import annotations

import asyncio
import http.client
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.core.errors import ConfigError
from orchestrator.core.models import Rollout, ToolCallRecord, Turn
from orchestrator.core.policy import REPLAY_URL
from orchestrator.server.app import Orchestrator
from orchestrator.testing.synthetic_rollouts import long_rollout
from orchestrator.viewer import sources
from orchestrator.viewer.html import seg
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, serve
from tests.viewer.conftest import Browser, serve_file, write_jsonl

TOKEN_A = "a" * 32
TOKEN_B = "b" * 32
HOSTILE = "<script>document.title='pwned'</script><img src=x onerror=alert(1)>"


def _request(
    url: str, path: str, method: str = "GET", headers: dict[str, str] | None = None, body: str | None = None
) -> tuple[int, dict[str, str], str]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode()
    finally:
        conn.close()


async def get(url: str, path: str, **kw: object) -> tuple[int, dict[str, str], str]:
    """A request from a thread: a live viewer calls back into this test's event loop."""
    return await asyncio.to_thread(_request, url, path, **kw)  # type: ignore[arg-type]


def _hostile_rollout() -> Rollout:
    r = long_rollout(turns=4, tool_output=HOSTILE)
    call = ToolCallRecord(id='c"><b>x', name="<i>python</i>", arguments=HOSTILE)
    r.turns.append(Turn(role="assistant", text=HOSTILE, tool_calls=[call]))
    return r.model_copy(update={"task_id": '"><script>alert(2)</script>'})


async def test_hostile_rollout_text_is_escaped_in_the_browser(browser: Browser, tmp_path: Path) -> None:
    r = _hostile_rollout()
    with serve_file(write_jsonl(tmp_path / "evil.jsonl", [r])) as viewer:
        status, headers, raw = await get(viewer.url, f"/job/{seg(r.job_id)}/rollout/{seg(r.id)}")
        job_page = await browser.dom(f"{viewer.url}/job/{seg(r.job_id)}")
        dom = await browser.dom(f"{viewer.url}/job/{seg(r.job_id)}/rollout/{seg(r.id)}")
    assert status == 200
    assert (
        "script-src" not in headers["content-security-policy"]
        and "default-src 'none'" in headers["content-security-policy"]
    )
    for page in (raw, dom, job_page):
        assert "<script" not in page.lower() and "<img" not in page.lower() and "<i>python" not in page
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom  # shown, as text
    assert "<title>pwned</title>" not in dom


@pytest.fixture
async def tenants(tmp_path: Path) -> AsyncIterator[tuple[Orchestrator, str]]:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"tokens:\n  {TOKEN_A}: team-a\n  {TOKEN_B}: team-b\n")
    async with serve(tmp_path / "data", backend=FAKE, ui_port=0, security={"token_file": tokens}) as orch:
        task_ids = [t.id for t in orch.jobs.registry.get(ENV).tasks()][:2]
        job_id, _ = await orch.jobs.submit(job(REPLAY_URL, task_ids, n=2), owner="team-a")
        assert len([e async for batch in orch.jobs.stream(job_id) for e in batch.entries]) == 4
        yield orch, job_id


async def test_a_tenant_sees_only_its_own_jobs(tenants: tuple[Orchestrator, str]) -> None:
    orch, job_id = tenants
    assert orch.ui is not None
    url = orch.ui.url
    a = {"Authorization": f"Bearer {TOKEN_A}"}
    b = {"Authorization": f"Bearer {TOKEN_B}"}
    rollout_id = f"{job_id}:{next(iter(orch.jobs.registry.get(ENV).tasks())).id}:0"
    paths = [f"/job/{seg(job_id)}", f"/job/{seg(job_id)}/rollout/{seg(rollout_id)}"]

    status, _, page = await get(url, "/", headers=a)
    assert status == 200 and job_id in page
    for path in paths:
        status, _, page = await get(url, path, headers=a)
        assert status == 200 and job_id in page, path

    status, _, page = await get(url, "/", headers=b)
    assert status == 200 and job_id not in page and "No jobs yet" in page
    for path in paths:
        status, _, page = await get(url, path, headers=b)
        assert status == 404 and "no job" in page, path  # exactly like a job that does not exist

    status, headers, page = await get(url, "/")
    assert status == 401 and "missing bearer token" in page and headers["www-authenticate"] == "Bearer"
    status, _, page = await get(url, "/", headers={"Authorization": "Bearer " + "c" * 32})
    assert status == 401 and job_id not in page


async def test_the_login_form_sets_an_http_only_cookie(tenants: tuple[Orchestrator, str]) -> None:
    orch, job_id = tenants
    assert orch.ui is not None
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _, page = await get(orch.ui.url, "/login", method="POST", headers=form, body="token=" + "c" * 32)
    assert status == 401 and "invalid bearer token" in page
    status, headers, _ = await get(orch.ui.url, "/login", method="POST", headers=form, body=f"token={TOKEN_A}")
    assert status == 303 and headers["location"] == "/"
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    status, _, page = await get(orch.ui.url, "/", headers={"Cookie": cookie.split(";", 1)[0]})
    assert status == 200 and job_id in page


async def test_the_login_form_takes_no_header_of_the_senders_and_no_other_sites_post(tmp_path: Path) -> None:
    # without tokens any token passed, and it went into Set-Cookie as sent: a CR/LF in it added a cookie for every
    # port of 127.0.0.1 and a redirect, from any site's page that auto-submitted a form to the viewer
    async with serve(tmp_path / "data", backend=FAKE, ui_port=0) as orch:
        assert orch.ui is not None
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        injected = "token=x%0d%0aSet-Cookie:%20session=attacker%0d%0aRefresh:%200;url=http://evil.example/"
        status, headers, page = await get(orch.ui.url, "/login", method="POST", headers=form, body=injected)
        assert status == 400 and "visible ASCII" in page
        assert "refresh" not in headers and "session=attacker" not in headers.get("set-cookie", "")
        cross = {**form, "Sec-Fetch-Site": "cross-site"}
        status, headers, page = await get(orch.ui.url, "/login", method="POST", headers=cross, body="token=abc")
        assert status == 403 and "posted from another site" in page and "set-cookie" not in headers
        other = {**form, "Origin": "http://evil.example"}
        assert (await get(orch.ui.url, "/login", method="POST", headers=other, body="token=abc"))[0] == 403
        same = {**form, "Sec-Fetch-Site": "same-origin"}
        assert (await get(orch.ui.url, "/login", method="POST", headers=same, body="token=abc"))[0] == 303


def test_a_huge_text_is_shown_cut() -> None:
    # a tool output of 16 MiB of quotes was a page of 96 MiB, about 500 MiB of the control plane's memory a request
    from orchestrator.viewer.html import SHOWN_CHARS, folded

    shown = folded('"' * (SHOWN_CHARS + 10))
    assert "[... 10 more characters not shown]" in shown and len(shown) < 7 * SHOWN_CHARS


async def test_pages_render_a_few_at_once_and_the_rest_wait_their_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each request rendered on a thread of its own, however many came: a few tabs of a huge rollout at once took the
    # control plane's memory
    from orchestrator.viewer import http

    monkeypatch.setattr(http, "RENDER_WAIT_S", 0.2)
    async with serve(tmp_path / "data", backend=FAKE, ui_port=0) as orch:
        assert orch.ui is not None
        held = 0
        while orch.ui.renders.acquire(blocking=False):
            held += 1
        try:
            assert held == http.MAX_RENDERS
            status, _, page = await get(orch.ui.url, "/")
            assert status == 503 and "Busy" in page
        finally:
            for _ in range(held):
                orch.ui.renders.release()
        assert (await get(orch.ui.url, "/"))[0] == 200


async def test_without_tokens_it_is_read_only_and_answers_loopback_names_only(tmp_path: Path) -> None:
    async with serve(tmp_path / "data", backend=FAKE, ui_port=0) as orch:
        assert orch.ui is not None
        url, port = orch.ui.url, orch.ui.port
        assert (await get(url, "/"))[0] == 200
        status, _, page = await get(url, "/", headers={"Host": f"attacker.example:{port}"})
        assert status == 403 and "loopback host names only" in page
        assert (await get(url, "/", method="PUT", body="x"))[0] == 405
        assert (await get(url, "/job/x", method="DELETE"))[0] == 405
        assert (await get(url, "/", method="POST", body="x"))[0] == 404
        assert (await get(url, "/no/such/page"))[0] == 404


async def test_a_viewer_off_loopback_without_tokens_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"refusing to serve on '0\.0\.0\.0'.*no --token-file"):
        async with serve(tmp_path / "data", backend=FAKE, ui_port=0, ui_host="0.0.0.0"):
            pass


async def test_a_live_viewer_keeps_the_rows_of_its_most_recently_viewed_jobs_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every job ever viewed stayed indexed, a row per rollout, removed jobs too
    monkeypatch.setattr(sources, "MAX_INDEXED_JOBS", 2)
    async with serve(tmp_path / "data", backend=FAKE, ui_port=0) as orch:
        assert orch.ui is not None
        task_ids = [t.id for t in orch.jobs.registry.get(ENV).tasks()][:2]
        ids = []
        for _ in range(3):
            job_id, _ = await orch.jobs.submit(job(REPLAY_URL, task_ids))
            assert len([e async for batch in orch.jobs.stream(job_id) for e in batch.entries]) == 2
            ids.append(job_id)
        for job_id in [*ids, ids[0]]:  # the first again, after it was dropped: indexed again, whole
            status, _, page = await get(orch.ui.url, f"/job/{seg(job_id)}")
            assert status == 200 and all(f"/rollout/{job_id}%3A{t}%3A0" in page for t in task_ids)
        source = orch.ui.source
        assert isinstance(source, sources.LiveSource)
        assert source.indexed_jobs() == [ids[2], ids[0]]


async def test_a_live_group_page_decodes_no_sample_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the page decoded every sample's payload into a Rollout to show its status, reward and last message: a group of
    # 1,024 samples of 8 MiB episodes (a tenant's own policy server fills them) was ~20 GiB of the control plane
    async with serve(tmp_path / "data", backend=FAKE, ui_port=0) as orch:
        assert orch.ui is not None
        task_id = next(iter(orch.jobs.registry.get(ENV).tasks())).id
        job_id, _ = await orch.jobs.submit(job(REPLAY_URL, [task_id], n=3))
        assert len([e async for batch in orch.jobs.stream(job_id) for e in batch.entries]) == 3
        source = orch.ui.source
        assert isinstance(source, sources.LiveSource)
        group_id = f"{job_id}:{task_id}"
        # from a thread, as the viewer's: the source asks this loop who may see the job
        shown = [await asyncio.to_thread(source.rollout, None, job_id, f"{group_id}:{i}") for i in range(3)]
        rollouts = [s.rollout for s in shown]
        want = [sources.Sample.of(r) for r in rollouts]

        def whole(row: object) -> Rollout:
            raise AssertionError("a group page decoded a sample whole")

        monkeypatch.setattr(sources, "_decode", whole)
        assert await asyncio.to_thread(source.group, None, job_id, group_id) == want
        status, _, page = await get(orch.ui.url, f"/job/{seg(job_id)}/group/{seg(group_id)}")
        assert status == 200 and page.count('class="card sample"') == 3, page[-2000:]


def test_a_group_pages_fields_from_sqlite_are_the_rollouts_own() -> None:
    # the live source takes a sample's fields with SQLite's JSON functions (the tail of the last assistant text
    # too): they must read as Sample.of reads the decoded rollout, an error, a reward of None and wide characters
    # included; a row that is no JSON is left out rather than failing the page
    import sqlite3

    from orchestrator.core.models import RolloutError, RolloutStatus

    ok = long_rollout(turns=5)
    ok.turns.append(Turn(role="assistant", text="\U0001f600é" * 400 + "the end"))
    ok.turns.append(Turn(role="assistant", text=""))  # the last with text counts
    failed = long_rollout(turns=2).model_copy(
        update={
            "id": f"{ok.group_id}:1",
            "sample_index": 1,
            "status": RolloutStatus.INFRA_ERROR,
            "reward": None,
            "error": RolloutError(kind="WorkerLostError", message="gone"),
        }
    )
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE rollouts (seq INTEGER, rollout_id TEXT, job_id TEXT, group_id TEXT, status TEXT, payload)")
    for seq, r in enumerate((ok, failed, None)):
        payload = "{damaged" if r is None else r.model_dump_json()
        rid = f"{ok.group_id}:9" if r is None else r.id
        db.execute("INSERT INTO rollouts VALUES (?, ?, ?, ?, ?, ?)", (seq, rid, ok.job_id, ok.group_id, "OK", payload))
    db.execute("UPDATE rollouts SET status = 'INFRA_ERROR' WHERE seq = 1")
    got = sources.read_group(db, ok.job_id, ok.group_id)
    assert got == [sources.Sample.of(ok), sources.Sample.of(failed)]
    assert got[0].last_text.endswith("the end") and len(got[0].last_text) == sources.LAST_TEXT_CHARS


def test_idle_connections_cannot_take_a_thread_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a thread per connection, unbounded, before any token was checked: 10,000 idle sockets were 10,000 threads of
    # the control plane's process (its gRPC and to_thread calls share them). Past the bound they wait to be accepted
    import socket
    import threading

    from orchestrator.viewer import http as viewer_http

    monkeypatch.setattr(viewer_http, "MAX_CONNECTIONS", 8)
    with serve_file(write_jsonl(tmp_path / "r.jsonl", [long_rollout(turns=2)])) as viewer:
        host, port = viewer.url.removeprefix("http://").rsplit(":", 1)
        before = threading.active_count()
        idle: list[socket.socket] = []
        try:
            for _ in range(24):
                s = socket.socket()
                s.settimeout(0.2)
                try:
                    s.connect((host, int(port)))
                except OSError:  # the listen queue is full: the kernel holds the rest
                    s.close()
                    continue
                idle.append(s)
            time.sleep(0.5)
            assert threading.active_count() - before <= 8, threading.active_count() - before
        finally:
            for s in idle:
                s.close()
        # the idle ones gone, the viewer answers again
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = http.client.HTTPConnection(host, int(port), timeout=10)
                conn.request("GET", "/")
                assert conn.getresponse().status == 200
                conn.close()
                break
            except (OSError, http.client.HTTPException):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def test_a_request_head_sent_a_byte_at_a_time_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # each read waited 30 s, so a client sending a header byte every 29 s held its connection's slot for good (and
    # 64 such clients held the viewer); an idle keep-alive connection is closed the same way
    import socket

    from orchestrator.viewer import http as viewer_http

    monkeypatch.setattr(viewer_http, "HEAD_DEADLINE_S", 1.5)
    with serve_file(write_jsonl(tmp_path / "r.jsonl", [long_rollout(turns=2)])) as viewer:
        host, port = viewer.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            slow.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n")
            t0 = time.monotonic()
            closed = False
            while time.monotonic() - t0 < 8 and not closed:
                try:
                    slow.sendall(b"X")
                    slow.settimeout(0.5)
                    closed = slow.recv(1024) == b""
                except TimeoutError:
                    continue
                except OSError:  # reset: closed too
                    closed = True
            assert closed and time.monotonic() - t0 < 5, time.monotonic() - t0
        # a quick client is served as before; kept alive and then idle, its connection is closed the same way
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/")
            response = conn.getresponse()
            assert response.status == 200 and response.read()
            assert conn.sock is not None
            conn.sock.settimeout(8)
            t0 = time.monotonic()
            assert conn.sock.recv(1) == b"" and time.monotonic() - t0 < 5  # closed by the server, idle past 1.5 s
        finally:
            conn.close()


def test_a_group_page_shows_no_advantages_over_part_of_a_group() -> None:
    # a group still filling (its other samples not logged yet), or one a damaged row is missing from: advantages over
    # the part are numbers the trainer never gets (the stream sends a group once it is whole)
    from orchestrator.core.models import RolloutStatus
    from orchestrator.viewer.pages import group_page

    samples = [sources.Sample(f"j:t:{k}", "t", k, RolloutStatus.OK, float(k), 1, 0.1, None, "") for k in range(2)]
    view = sources.JobView("j", "env", "RUNNING", 4, 2, {}, 0.0, group_size=4)
    page = group_page(view, "j:t", samples)
    assert "2 samples of 4 (advantages once the group is whole)" in page and 'class="adv">-' not in page
    assert page.count('advantage <b class="adv">&ndash;</b>') == 2
    whole = group_page(
        view,
        "j:t",
        [*samples, *[sources.Sample(f"j:t:{k}", "t", k, RolloutStatus.OK, 0.0, 1, 0.1, None, "") for k in (2, 3)]],
    )
    assert 'advantage <b class="adv">&ndash;</b>' not in whole
