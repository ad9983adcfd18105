"""`envfleet envs import-harbor DIR... --name NAME`: check Harbor task directories, build their image offline,
run each oracle (must pass) and an empty solution (must fail), then save the environment under
$ENVFLEET_HARBOR_HOME/NAME (copies of the tasks and a manifest) for `environments.harbor.installed:NAME`.

With `--server HOST:PORT` the same checks run on that server instead: the task directories go there as one archive
(EnvironmentService.RegisterArchive, kind "harbor"), and the environment is registered for the caller's tenant."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.cli.remote import add_client_arguments

if TYPE_CHECKING:
    from rich.console import Console

    from environments.harbor.env import HarborEnvironment
    from environments.harbor.validate import TaskCheck

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `import-harbor`."""
    p.add_argument("dirs", nargs="+", type=Path, help="Harbor task directories (task.toml, instruction.md, ...)")
    p.add_argument("--name", required=True, help="the environment's name")
    p.add_argument("--version", default="1")
    p.add_argument("--home", type=Path, default=None, help="where to save it (default: $ENVFLEET_HARBOR_HOME)")
    p.add_argument("--no-validate", action="store_true", help="skip the oracle and empty-solution runs")
    p.add_argument("--owner", default="envfleet-harbor-import", help="owner label of the validation sandboxes")
    p.add_argument(
        "--visibility",
        choices=("private", "public"),
        default="private",
        help="with --server: who may use it (private: your tenant only)",
    )
    p.add_argument("--dry-run", action="store_true", help="with --server: validate there, register nothing")
    p.add_argument("--timeout", type=float, default=1800.0, help="with --server: seconds to wait for the server")
    add_client_arguments(p, None, "register on this orchestrator (default: save locally, for the server config)")


async def build_and_validate(env: HarborEnvironment, owner: str) -> tuple[str, list[TaskCheck]]:
    """Build the image (offline, tenant limits) and validate every task on real sandboxes."""
    from environments.harbor.validate import validate
    from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig
    from orchestrator.core.errors import ImageBuildError

    backend = await DockerBackend.start(DockerBackendConfig(owner=owner))
    try:
        try:
            image = await asyncio.to_thread(env.build_image, backend.client)
        except ImageBuildError as e:
            raise ImageBuildError(
                f"the image of the Harbor environment {env.name} did not build. Builds are offline (no network): "
                f"a step that downloads (apt-get, pip, curl, git clone) fails; put what it needs in the base image "
                f"or in environment/.\n{e}",
                log_path=e.log_path,
                step=e.step,
            ) from e
        return image, await validate(env, backend, image)
    finally:
        await backend.close()


def import_remote(args: argparse.Namespace, console: Console) -> int:
    """Pack the task directories (checked here first) and register, or with --dry-run validate, them on --server."""
    from environments.harbor.archive import KIND, pack
    from orchestrator.cli.errors import CommandLineError
    from orchestrator.cli.remote import connect
    from protos import orchestrator_pb2 as pb

    if args.no_validate:
        raise CommandLineError("--no-validate does not apply with --server: a server validates every registration")
    data = pack(args.dirs)
    message = pb.EnvironmentArchive(
        kind=KIND, name=args.name, version=args.version, archive=data, visibility=args.visibility
    )
    console.print(f"{args.name}@{args.version}: {len(args.dirs)} task(s), {len(data)} bytes to {args.server}")

    async def go() -> int:
        async with connect(args) as client:
            if args.dry_run:
                report = await client.env_stub.ValidateArchive(message, timeout=args.timeout)
                console.print(f"{report.env} is valid ({report.duration_s:.1f}s)", highlight=False)
                for check in report.checks:
                    console.print(f"  {check}", markup=False, highlight=False)
                return 0
            info = await client.env_stub.RegisterArchive(message, timeout=args.timeout)
        console.print(
            f"registered {info.name}@{info.version} on {args.server}: {info.num_tasks} task(s) validated "
            f"(each oracle passes, an empty solution fails), image {info.image}",
            highlight=False,
        )
        return 0

    return asyncio.run(go())


def save(env: HarborEnvironment, home: Path) -> Path:
    """Copy the task directories under home/NAME/tasks and write home/NAME/harbor.json; returns the manifest."""
    root = home / env.name
    tmp = home / f".{env.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "tasks").mkdir(parents=True)
    for task_id, task in env.harbor_tasks.items():
        shutil.copytree(task.path, tmp / "tasks" / task_id, symlinks=True)
    doc = {
        "name": env.name,
        "version": env.version,
        "tasks": [f"tasks/{t}" for t in env.harbor_tasks],
        "validated": env.validated,
    }
    (tmp / "harbor.json").write_text(json.dumps(doc, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root / "harbor.json"


def import_harbor(args: argparse.Namespace, console: Console) -> int:
    """The command: exit 0 when every task validated and the environment was saved, 1 otherwise."""
    import re

    from environments.harbor.env import make_harbor_environment, mark_validated
    from environments.harbor.installed import harbor_home
    from orchestrator.cli.errors import CommandLineError

    if not re.match(NAME_PATTERN, args.name):
        raise CommandLineError(f"--name {args.name!r} must match {NAME_PATTERN}")
    if args.server:
        return import_remote(args, console)
    env = make_harbor_environment(args.name, args.dirs, args.version)
    console.print(f"{env.ref()}: {len(env.harbor_tasks)} task(s), limits {env.limits.model_dump()}")
    if not args.no_validate:
        image, checks = asyncio.run(build_and_validate(env, args.owner))
        console.print(f"image {image}")
        bad = 0
        for c in checks:
            mark = "ok" if not c.problems else "FAILED"
            console.print(f"  {c.task_id}: {mark} (oracle {c.oracle}, empty {c.empty})")
            for p in c.problems:
                console.print(f"    {p}", markup=False)
            bad += bool(c.problems)
        if bad:
            console.print(f"{bad} task(s) failed validation; nothing saved")
            return 1
        mark_validated(env)
    manifest = save(env, args.home or harbor_home())
    console.print(f"saved {manifest}; serve it with environments: ['environments.harbor.installed:{env.name}']")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `envfleet.cli` entry point: adds `import-harbor` under `envfleet envs`."""
    envs = sub.choices.get("envs")
    group = next(
        (a for a in (envs._actions if envs else []) if isinstance(a, argparse._SubParsersAction)),
        sub,
    )
    p = group.add_parser("import-harbor", help="import Harbor / Terminal-Bench task directories as an environment")
    add_arguments(p)

    def run(args: argparse.Namespace) -> int:
        from orchestrator.cli.main import terminal_console

        return import_harbor(args, terminal_console())

    p.set_defaults(fn=run)
