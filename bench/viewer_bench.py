"""The trajectory viewer's figures (not a test: timing targets live here): server-side render time of one rollout of
100 turns, and the rollouts table over 100,000 rollouts (load, first query per order, a later page).

    python -m bench.viewer_bench [--rollouts 100000] [--screenshot docs/rollout.png]

Prints JSON. With --screenshot, also saves a PNG of a short rollout's page from headless Chromium (the README's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from orchestrator.cli.view import toy_decoder
from orchestrator.service.store import SCHEMA
from orchestrator.testing.synthetic_rollouts import long_rollout, many_rollouts
from orchestrator.viewer import FileSource, ViewerServer, start_viewer
from orchestrator.viewer.html import seg
from orchestrator.viewer.index import Query
from orchestrator.viewer.sources import read_rows


def _timed(fn: object, repeat: int = 1) -> float:
    """The median seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(n: int, work: Path) -> dict[str, float]:
    """Write the files, load them, and time the pages."""
    out: dict[str, float] = {}
    long = long_rollout(turns=100)
    path = work / "rollouts.jsonl"
    with path.open("w") as f:
        for r in many_rollouts(n):
            f.write(r.model_dump_json() + "\n")
        f.write(long.model_dump_json() + "\n")
    t0 = time.perf_counter()
    source = FileSource(path)
    out["file_load_s"] = time.perf_counter() - t0
    viewer = ViewerServer(source, decoder_for=toy_decoder)
    rollout_path = f"/job/{seg(long.job_id)}/rollout/{seg(long.id)}"
    out["rollout_100_turns_render_s"] = _timed(lambda: viewer.render(rollout_path, {}, None), repeat=20)
    out["rollout_100_turns_html_kb"] = len(viewer.render(rollout_path, {}, None)) / 1024
    index = source.index(None, "job-many")
    for sort in ("seq", "reward", "duration"):
        index.add([])  # drop the cached orders: a first query sorts
        out[f"table_{n}_first_query_sort_{sort}_s"] = _timed(lambda s=sort: index.query(Query(sort=s, desc=True)))  # type: ignore[misc]
    out[f"table_{n}_later_page_s"] = _timed(lambda: index.query(Query(sort="duration", desc=True, page=900)), 20)
    out[f"job_page_{n}_render_s"] = _timed(lambda: viewer.render("/job/job-many", {"status": "OK"}, None), 5)
    out[f"live_log_{n}_read_rows_s"] = _live_read(path, work)
    return out


def _live_read(jsonl: Path, work: Path) -> float:
    """Seconds to read the table rows of a job of n rollouts from a result log (a live viewer's first look)."""
    db_path = work / "results.sqlite3"
    db = sqlite3.connect(db_path)
    db.executescript(SCHEMA)
    with jsonl.open() as f:
        lines = [(json.loads(line), line.strip()) for line in f]
    db.executemany(
        "INSERT INTO rollouts (job_id, rollout_id, group_id, status, payload) VALUES (?, ?, ?, ?, ?)",
        [(d["job_id"], d["id"], d["group_id"], d["status"], line) for d, line in lines],
    )
    db.commit()
    db.close()
    reader = sqlite3.connect(f"{db_path.as_uri()}?mode=ro", uri=True)
    try:
        return _timed(lambda: read_rows(reader, "job-many", 0), 3)
    finally:
        reader.close()


def screenshot(out: Path, work: Path) -> None:
    """A PNG of a short rollout's page (turns, timing, tokens by mask) from headless Chromium."""
    browser = shutil.which("chromium")
    if browser is None:
        raise SystemExit("chromium is not installed: make chromium")
    r = long_rollout(turns=4, tool_output="done")
    path = work / "shot.jsonl"
    path.write_text(r.model_dump_json() + "\n")
    with start_viewer(FileSource(path), decoder_for=toy_decoder) as viewer:
        url = f"{viewer.url}/job/{seg(r.job_id)}/rollout/{seg(r.id)}"
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={work / 'p'}"]
        args += ["--window-size=1280,1120", f"--screenshot={out.resolve()}", url]
        subprocess.run([browser, *args], check=True, capture_output=True, timeout=120)


def main() -> None:
    """Run the benchmark and print its figures as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=100_000)
    p.add_argument("--screenshot", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = bench(args.rollouts, Path(tmp))
        if args.screenshot:
            screenshot(args.screenshot, Path(tmp))
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}, indent=2))


if __name__ == "__main__":
    main()
