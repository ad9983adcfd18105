"""`make demo`: an orchestrator process on local Docker, the scripted policy, and a job of scored rollouts streamed
to a client, printed as a table and written as JSONL.

The policy is the double of a Qwen3 model on vLLM (its template drops old thinking and re-serializes tool calls), and
the job runs token-in, token-out, so the table's `complete` token arrays are exact, as they would be with Qwen3."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import ConfigError
from orchestrator.core.models import JobSpec, Rollout, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.service.registry import Registry
from orchestrator.testing.qwen_like import QWEN_LIKE_DIR
from orchestrator.testing.scripted_policy import Script, start_scripted_server
from orchestrator.testing.scripts import reference_script

DEMO_ENV = "python-tool"
CANCEL_ON_EXIT_S = 10.0  # for the job's CancelJob when the client stops early


async def collect_rollouts(client: EnvfleetClient, spec: JobSpec, out: Path, console: Console) -> int:
    """Submit `spec`, stream every rollout with a live progress line, write JSONL, print a table; closes the client.
    The rollouts go to a file beside `out`, made before the submit (one that cannot be written failed the client
    after its job was submitted, the job running on), and moved onto `out` once the job has ended or the client
    stops: a submit that fails leaves `out` as it was. An `out` that is no plain file (/dev/stdout, a link, a pipe)
    is written as it is, once the job is submitted."""
    rollouts: list[Rollout] = []
    counts: Counter[str] = Counter()
    partial = _partial_beside(out)
    submitted = False
    try:
        async with client:
            job_id = await client.submit(spec)
            submitted = True
            with (partial or out).open("w", encoding="utf-8") as f:
                try:
                    total = (await client.get_job(job_id)).total
                    t0 = time.monotonic()
                    progress = Progress(
                        TextColumn("[bold]job {task.fields[job]}"),
                        BarColumn(),
                        MofNCompleteColumn(),
                        TextColumn("{task.fields[stats]}"),
                        TimeElapsedColumn(),
                        console=console,
                    )
                    with progress:
                        bar = progress.add_task("rollouts", total=total, job=job_id, stats="")
                        async for r in client.rollouts(job_id):
                            rollouts.append(r)
                            counts[r.status.value] += 1
                            f.write(r.model_dump_json() + "\n")
                            rate = len(rollouts) / max(time.monotonic() - t0, 1e-9)
                            failed = sum(v for k, v in counts.items() if k not in ("OK", "TRUNCATED"))
                            stats = f"ok {counts['OK']} failed {failed} | {rate:.2f} rollouts/s"
                            progress.update(bar, advance=1, stats=stats)
                except BaseException:
                    # stopped (Ctrl-C) or failed: the job is cancelled, not left running on the server (its policy
                    # server's GPUs with it) with nobody reading it
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(asyncio.shield(client.cancel_job(job_id)), CANCEL_ON_EXIT_S)
                        console.print(f"job {job_id} cancelled; {len(rollouts)} rollouts written to {out}")
                    raise
    finally:
        if partial is not None:
            if submitted:
                os.replace(partial, out)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
    _print_table(console, rollouts)
    console.print(f"{len(rollouts)} rollouts written to {out}; by status: {dict(counts)}")
    return 0 if len(rollouts) == total else 1


def _partial_beside(out: Path) -> Path | None:
    """An empty file beside `out` for the rollouts, with the mode `open(out, "w")` would give (None: `out` is no
    plain file, and is written as it is); ConfigError naming `out` when neither can be written."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file")
    if out.is_symlink() or (out.exists() and not out.is_file()):
        if not os.access(out, os.W_OK):
            raise ConfigError(f"cannot write --out {out}: permission denied")
        return None
    try:
        fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    except OSError as e:
        raise ConfigError(f"cannot write --out {out}: {e.strerror or e}") from None
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    os.close(fd)
    return Path(name)


def _print_table(console: Console, rollouts: list[Rollout]) -> None:
    table = Table(title="scored rollouts")
    for col in ("task", "sample", "status", "reward", "turns", "tokens", "acquire s", "gen s", "tools s", "total s"):
        table.add_column(col, justify="left" if col in ("task", "status", "tokens") else "right")
    for r in sorted(rollouts, key=lambda r: (r.task_id, r.sample_index)):
        t = r.timing
        table.add_row(
            r.task_id,
            str(r.sample_index),
            r.status.value,
            "-" if r.reward is None else f"{r.reward:.2f}",
            str(sum(x.role == "assistant" for x in r.turns)),
            f"{r.tokens.status} ({len(r.tokens.completion_ids)})",
            f"{t.sandbox_acquire:.2f}",
            f"{t.generation:.3f}",
            f"{t.tools:.3f}",
            f"{t.total:.2f}",
        )
    console.print(table)


async def start_orchestrator_process(data_dir: Path, owner: str, *extra: str) -> tuple[asyncio.subprocess.Process, str]:
    """`envfleet serve` in its own process on a free port; returns it and its address once it listens."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orchestrator.cli",
        "serve",
        "--port",
        "0",
        "--data-dir",
        str(data_dir),
        "--owner",
        owner,
        *extra,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 300)
    if not line.startswith(b"listening "):
        proc.kill()
        await proc.wait()
        raise RuntimeError("the orchestrator did not start (see its log above)")
    return proc, line.split()[1].decode()


async def run_job_demo(console: Console, out: Path, num_tasks: int, n: int) -> int:
    """The main job, end to end, on a fresh data dir; everything it starts is stopped at the end."""
    env = Registry.from_entry_points().get(DEMO_ENV)
    tasks = list(env.tasks())
    # the scripted policy solves every other task and answers the rest wrongly, so rewards differ
    solve = reference_script(env, tasks[0::2])
    wrong = reference_script(env, tasks[1::2], mode="wrong")
    script = Script(tasks={**solve.tasks, **wrong.tasks}, latency_s=0.05, template="qwen3")
    policy = await start_scripted_server(script)
    with tempfile.TemporaryDirectory(prefix="envfleet-demo-") as data:
        console.print(f"scripted policy (a Qwen3-like model server) at {policy.url}; starting the orchestrator ...")
        tokenizers = ("--tokenizer-dir", str(QWEN_LIKE_DIR.parent))
        proc, address = await start_orchestrator_process(Path(data), "envfleet-demo", *tokenizers)
        try:
            console.print(f"orchestrator at {address}; submitting {num_tasks} tasks x {n} samples on {DEMO_ENV}")
            spec = JobSpec(
                env=DEMO_ENV,
                tasks=TaskSelection(kind="ids", ids=[t.id for t in tasks[:num_tasks]]),
                group_size=n,
                # token_mode is tito because a tokenizer is named: ids in, ids out, never re-tokenized
                policy=PolicyEndpoint(
                    base_url=policy.url, model="scripted", version="demo-1", tokenizer=QWEN_LIKE_DIR.name
                ),
                max_concurrency=8,
            )
            return await collect_rollouts(EnvfleetClient(address), spec, out, console)
        finally:
            proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 30)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await policy.close()
