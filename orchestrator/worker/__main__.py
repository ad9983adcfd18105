"""`python -m orchestrator.worker --connect TARGET --config JSON`: one rollout worker process. The worker token is
read from standard input (one line), so it never appears in a command line or an environment."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys

from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.process import run_worker

log = logging.getLogger("orchestrator.worker")

PR_SET_PDEATHSIG = 1


async def _serve(target: str, token: str, config: WorkerConfig, name: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run_worker(target, token, config, name, stop)


def _die_with_parent(parent_pid: int) -> None:
    """A local worker must not outlive its control plane: killed with it (PR_SET_PDEATHSIG), its sandboxes are
    left to the sweep of the next start, as a crashed control plane's own are."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("could not tie this worker's life to its control plane (errno %d)", ctypes.get_errno())
    if os.getppid() != parent_pid:  # the control plane died before the tie was made
        sys.exit("the control plane is gone")


def main(argv: list[str] | None = None) -> None:
    """Entry point of a worker process."""
    p = argparse.ArgumentParser(prog="python -m orchestrator.worker")
    p.add_argument("--connect", required=True, help="the control plane's worker address (unix:PATH or HOST:PORT)")
    p.add_argument("--config", default="{}", help="WorkerConfig as JSON")
    p.add_argument("--name", default="worker")
    p.add_argument("--parent-pid", type=int, default=0, help="die with this process (a local worker's control plane)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format=f"%(asctime)s %(levelname)s {args.name} %(name)s: %(message)s",
    )
    if args.parent_pid:
        _die_with_parent(args.parent_pid)
    token = sys.stdin.readline().strip()
    if not token:
        sys.exit("the worker token must come on standard input")
    asyncio.run(_serve(args.connect, token, WorkerConfig.model_validate_json(args.config), args.name))


if __name__ == "__main__":
    main()
