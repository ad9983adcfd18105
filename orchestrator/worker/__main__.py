"""`python -m orchestrator.worker --connect TARGET --config JSON`: one rollout worker process. The worker token is
read from standard input (one line), so it never appears in a command line or an environment. Over TCP to a control
plane that serves TLS: `--tls-ca` (and `--tls-cert/--tls-key` when it requires worker certificates)."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

from orchestrator.client.auth import ClientTLS, check_client_transport
from orchestrator.core.log_text import TextFormatter
from orchestrator.core.runtime import limit_malloc_arenas
from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.process import run_worker

log = logging.getLogger("orchestrator.worker")

PR_SET_PDEATHSIG = 1


async def _serve(
    target: str, token: str, config: WorkerConfig, name: str, tls: ClientTLS | None, insecure: bool
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run_worker(target, token, config, name, stop, tls=tls, insecure=insecure)


def _tls(args: argparse.Namespace) -> ClientTLS | None:
    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None
    if bool(args.tls_cert) != bool(args.tls_key):
        sys.exit("--tls-cert and --tls-key go together")
    try:
        return ClientTLS.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    except OSError as e:
        sys.exit(f"cannot read {e.filename}: {e.strerror}")


def _die_with_parent(parent_pid: int) -> None:
    """A local worker must not outlive its control plane: killed with it (PR_SET_PDEATHSIG), its sandboxes are
    left to the sweep of the next start, as a crashed control plane's own are."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("could not tie this worker's life to its control plane (errno %d)", ctypes.get_errno())
    if os.getppid() != parent_pid:  # the control plane died before the tie was made
        sys.exit("the control plane is gone")


def configure_logging(name: str, verbose: int) -> None:
    """The worker's log lines on stderr: a local worker's stderr is its control plane's, so its lines are escaped
    alike (a scoring command's output, logged here, wrote forged lines of its own)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter(f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), handlers=[handler], force=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point of a worker process."""
    limit_malloc_arenas()  # before gRPC starts its threads
    p = argparse.ArgumentParser(prog="python -m orchestrator.worker")
    p.add_argument("--connect", required=True, help="the control plane's worker address (unix:PATH or HOST:PORT)")
    p.add_argument("--config", default="{}", help="WorkerConfig as JSON")
    p.add_argument("--name", default="worker")
    p.add_argument("--tls-ca", type=Path, help="speak TLS, trusting this CA (PEM) for the control plane's certificate")
    p.add_argument("--tls-cert", type=Path, help="this worker's certificate (PEM), when the control plane wants mTLS")
    p.add_argument("--tls-key", type=Path, help="this worker's private key (PEM)")
    p.add_argument("--insecure", action="store_true", help="allow sending the token in clear to a remote address")
    p.add_argument("--parent-pid", type=int, default=0, help="die with this process (a local worker's control plane)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    configure_logging(args.name, args.verbose)
    if args.parent_pid:
        _die_with_parent(args.parent_pid)
    tls = _tls(args)
    token = sys.stdin.readline().strip()
    if not token:
        sys.exit("the worker token must come on standard input")
    try:
        check_client_transport(args.connect, token, tls, args.insecure)
    except ValueError as e:
        sys.exit(f"{e} (here: --tls-ca CA.pem, or --insecure)")
    config = WorkerConfig.model_validate_json(args.config)
    asyncio.run(_serve(args.connect, token, config, args.name, tls, args.insecure))


if __name__ == "__main__":
    main()
