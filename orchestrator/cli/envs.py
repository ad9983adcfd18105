"""`envfleet envs list|describe|validate|register`: with `--server ADDR` they ask that orchestrator (its
EnvironmentService); without it, list/describe/validate read the local registry (entry points), the validation of
a spec file uses an orchestrator started in this process and then the checker on every task, and register asks
the server at its default address (127.0.0.1:50051)."""

from __future__ import annotations

import argparse
import asyncio
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from orchestrator.cli.errors import CommandLineError
from orchestrator.cli.remote import add_client_arguments, orchestrator_client
from orchestrator.core.tools import tool_names
from protos import orchestrator_pb2 as pb

if TYPE_CHECKING:
    from orchestrator.core.environment import Environment

SPEC_SUFFIXES = (".yaml", ".yml", ".json")
LOCAL_HELP = "orchestrator address (default: the local registry of installed plug-ins)"


def add_envs_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser], console: Console) -> None:
    """The `envs` command group."""
    envs = sub.add_parser("envs", help="registered environments").add_subparsers(dest="envs_command", required=True)

    ls = envs.add_parser("list", help="environments of a server (--server) or of the local registry")
    add_client_arguments(ls, None, LOCAL_HELP)
    ls.set_defaults(fn=partial(cmd_list, console=console))

    describe = envs.add_parser("describe", help="one environment: tools, tasks, limits")
    describe.add_argument("name", help="name or name@version")
    add_client_arguments(describe, None, LOCAL_HELP)
    describe.set_defaults(fn=partial(cmd_describe, console=console))

    validate = envs.add_parser(
        "validate",
        help="check an environment on real sandboxes: a local one by name, or a declarative spec file (on --server, "
        "or on an orchestrator in this process)",
    )
    validate.add_argument("name", help="name or name@version (local registry), or a spec file (.yaml/.yml/.json)")
    validate.add_argument("--limit", type=int, default=None, help="check only the first N tasks (local only)")
    validate.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the server")
    add_client_arguments(validate, None, "orchestrator address (default: check on this host)")
    validate.set_defaults(fn=partial(cmd_validate, console=console))

    register = envs.add_parser("register", help="register a declarative environment (spec YAML) with a server")
    register.add_argument("spec", help="the spec: YAML or JSON (tasks_file and image.dockerfile_file are relative)")
    register.add_argument("--dry-run", action="store_true", help="only validate: build, load, run the reference")
    register.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the server")
    add_client_arguments(register)
    register.set_defaults(fn=partial(cmd_register, console=console))


def cmd_list(args: argparse.Namespace, console: Console) -> int:
    """A table of environments: the server's with --server, else the local registry's."""
    if args.server:

        async def remote() -> list[pb.EnvironmentInfo]:
            async with orchestrator_client(args) as client:
                return await client.list_envs()

        table = Table("environment", "tasks", "tools", "source", title=f"environments on {args.server}")
        for e in asyncio.run(remote()):
            table.add_row(f"{e.name}@{e.version}", str(e.num_tasks), ", ".join(t.name for t in e.tools), e.source)
        console.print(table)
        return 0
    from orchestrator.service.registry import Registry

    table = Table("environment", "tasks", "tools", "source", title="environments in the local registry")
    for r in Registry.from_entry_points().all():
        table.add_row(r.env.ref(), str(len(r.env.tasks())), ", ".join(tool_names(r.env.tools)), r.source)
    console.print(table)
    return 0


def cmd_describe(args: argparse.Namespace, console: Console) -> int:
    """One environment, from the server (Describe) with --server, else from the local registry."""
    if args.server:

        async def remote() -> pb.EnvironmentInfo:
            async with orchestrator_client(args) as client:
                return await client.describe_env(args.name)

        e = asyncio.run(remote())
        console.print(f"[bold]{e.name}@{e.version}[/bold]  {e.description}", highlight=False)
        console.print(
            f"source: {e.source}; tasks: {e.num_tasks}; max turns: {e.default_max_turns}; image: {e.image or '-'}",
            highlight=False,
        )
        for info in e.tools:
            console.print(f"  tool [cyan]{info.name}[/cyan]: {info.description}", highlight=False)
        return 0
    from orchestrator.core.tools import get_tools
    from orchestrator.service.registry import Registry

    r = Registry.from_entry_points().lookup(args.name)
    env = r.env
    console.print(f"[bold]{env.ref()}[/bold]  {env.description}")
    console.print(f"source: {r.source}; tasks: {len(env.tasks())}; max turns: {env.max_turns}")
    for tool in get_tools(env.tools):
        console.print(f"  tool [cyan]{tool.name}[/cyan]: {tool.description}")
    for task in list(env.tasks())[:3]:
        console.print(f"  task {task.id}: {task.prompt[:100]}")
    return 0


def _is_spec_file(name: str) -> bool:
    return name.endswith(SPEC_SUFFIXES) or Path(name).is_file()


def cmd_validate(args: argparse.Namespace, console: Console) -> int:
    """A spec file: EnvironmentService.Validate (on --server, else in process, and then the local checker on every
    task, as for a name). A name: the local checker; a server cannot check an environment by name, since Validate
    takes a spec."""
    if _is_spec_file(args.name):
        code = _validate_spec(args, console, dry_run=True)
        if code or args.server:
            return code
        # Validate ran one task's reference: a grader that fails on another task's data, or pays an empty answer,
        # passed it and scored the policy 0 (or 1) there
        from orchestrator.service.declarative import load_spec_file, make_environment

        env = make_environment(load_spec_file(Path(args.name)))
        return asyncio.run(_check_local(env, args.limit, console, references=False))
    if args.server:
        raise CommandLineError(
            f"{args.name!r} is not a spec file: over --server, envs validate checks a declarative spec "
            f"(EnvironmentService.Validate takes the spec, not a name, and built-in plug-ins have no spec to send). "
            f"To check the plug-in on this host's sandboxes, run `envfleet envs validate {args.name}` without --server"
        )
    from orchestrator.service.registry import Registry

    return asyncio.run(_check_local(Registry.from_entry_points().get(args.name), args.limit, console))


async def _check_local(env: Environment, limit: int | None, console: Console, *, references: bool = True) -> int:
    from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig
    from orchestrator.images.resolver import ImageResolver
    from orchestrator.service.checker import check_environment

    backend = await DockerBackend.start(DockerBackendConfig(owner="envfleet-validate"))
    try:
        images = ImageResolver(backend.client)
        report = await check_environment(env, backend, images, limit=limit, references=references)
    finally:
        await backend.close()
    for p in report.problems:
        console.print(f"[red]problem[/red] {p}")
    verdict = "[green]ok[/green]" if report.ok else f"[red]{len(report.problems)} problem(s)[/red]"
    console.print(f"{report.env}: {verdict}; {report.tasks_checked} tasks checked in {report.seconds:.1f}s")
    return 0 if report.ok else 1


def cmd_register(args: argparse.Namespace, console: Console) -> int:
    """Validate the spec locally, then Register (or Validate, with --dry-run) it on the server."""
    return _validate_spec(args, console, dry_run=args.dry_run, path=args.spec)


def _validate_spec(args: argparse.Namespace, console: Console, *, dry_run: bool, path: str | None = None) -> int:
    """Parse the spec file (problems one a line, exit 2), then Validate or Register it."""
    from orchestrator.server.convert_specs import spec_to_pb
    from orchestrator.service.declarative import SpecError, load_spec_file

    file = Path(path or args.name)
    err = Console(stderr=True)
    try:
        spec = load_spec_file(file)
    except SpecError as e:
        err.print(f"[red]{file}: {len(e.problems)} problem(s)[/red]")
        for problem in e.problems:
            err.print(f"  {problem.field}: {problem.message}", markup=False, highlight=False)
        return 2
    message = spec_to_pb(spec)

    async def go() -> int:
        async with orchestrator_client(args) as client:
            if dry_run:
                report = await client.env_stub.Validate(message, timeout=args.timeout)
                console.print(f"{report.env} is valid ({report.duration_s:.1f}s)", highlight=False)
                for check in report.checks:
                    console.print(f"  {check}", markup=False, highlight=False)
                return 0
            info = await client.env_stub.Register(message, timeout=args.timeout)
        console.print(
            f"registered {info.name}@{info.version}: {info.num_tasks} task(s), image {info.image}", highlight=False
        )
        return 0

    return asyncio.run(go())
