"""`python -m orchestrator.worker --connect TARGET --config JSON`: one rollout worker process. The worker token is
read from standard input (one line), so it never appears in a command line or an environment."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.process import run_worker

log = logging.getLogger("orchestrator.worker")


async def _serve(target: str, token: str, config: WorkerConfig, name: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run_worker(target, token, config, name, stop)


def main(argv: list[str] | None = None) -> None:
    """Entry point of a worker process."""
    p = argparse.ArgumentParser(prog="python -m orchestrator.worker")
    p.add_argument("--connect", required=True, help="the control plane's worker address (unix:PATH or HOST:PORT)")
    p.add_argument("--config", default="{}", help="WorkerConfig as JSON")
    p.add_argument("--name", default="worker")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format=f"%(asctime)s %(levelname)s {args.name} %(name)s: %(message)s",
    )
    token = sys.stdin.readline().strip()
    if not token:
        sys.exit("the worker token must come on standard input")
    asyncio.run(_serve(args.connect, token, WorkerConfig.model_validate_json(args.config), args.name))


if __name__ == "__main__":
    main()
