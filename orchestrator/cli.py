"""The `envfleet` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import docker
from rich.console import Console


def _cmd_image_build_base(args: argparse.Namespace) -> int:
    from orchestrator.images import ensure_base_image

    tag = ensure_base_image(docker.from_env())
    print(tag)
    return 0


def _cmd_image_build_orchestrator(args: argparse.Namespace) -> int:
    from orchestrator.images.orchestrator_image import ensure_orchestrator_image

    print(ensure_orchestrator_image(docker.from_env()))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from orchestrator.demo import run_demo
    from orchestrator.images import ensure_base_image

    image = args.image or ensure_base_image(docker.from_env())
    asyncio.run(run_demo(image, Console()))
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from orchestrator.backends.docker import DockerBackend, DockerBackendConfig

    async def go() -> int:
        backend = await DockerBackend.start(DockerBackendConfig(owner="envfleet-sweep"), sweep=False)
        try:
            return await backend.sweep(older_than=args.older_than)
        finally:
            await backend.close()

    print(f"removed {asyncio.run(go())} sandbox(es)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="envfleet", description="A sandboxed agent-environment fleet for RL rollouts.")
    p.add_argument("-v", "--verbose", action="count", default=0)
    sub = p.add_subparsers(dest="command", required=True)

    image = sub.add_parser("image", help="build images offline").add_subparsers(dest="image_command", required=True)
    image.add_parser("build-base", help="build (or reuse) the envd base image").set_defaults(fn=_cmd_image_build_base)
    image.add_parser("build-orchestrator", help="build the orchestrator's own image").set_defaults(
        fn=_cmd_image_build_orchestrator
    )

    demo = sub.add_parser("demo", help="drive one hardened sandbox through envd and show timings")
    demo.add_argument("--image", help="sandbox image (default: the base image)")
    demo.set_defaults(fn=_cmd_demo)

    sweep = sub.add_parser("sweep", help="remove sandboxes of dead owners and expired leases")
    sweep.add_argument("--older-than", type=float, default=None, help="also remove any sandbox older than N seconds")
    sweep.set_defaults(fn=_cmd_sweep)
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `envfleet` console script."""
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(args.fn(args))


if __name__ == "__main__":
    main()
