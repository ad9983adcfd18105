"""The `envfleet swe-eval`, `swe-validate` and `swe-build` commands (wired in orchestrator/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

# Light imports only at the top: orchestrator/cli.py imports this module to build its parser.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from orchestrator.backends.docker.backend import DockerBackend

log = logging.getLogger(__name__)


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return n


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `swe-eval`."""
    p.add_argument("--dataset", required=True, type=Path, help="instances (JSONL or JSON list)")
    p.add_argument(
        "--predictions", required=True, type=Path, help="SWE-bench predictions (JSONL or JSON), or `gold` / `empty`"
    )
    p.add_argument("--run-id", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--log-dir", type=Path, default=Path("logs/swe-eval"), help="where run folders go")
    p.add_argument("--timeout", type=float, default=None, help="test timeout in seconds (default: per instance)")
    p.add_argument("--instance-ids", nargs="*", help="only these instances")
    p.add_argument("--owner", default="envfleet-swe-eval", help="owner label of the sandboxes")
    p.add_argument(
        "--reuse-sandboxes",
        action="store_true",
        help="warm sandboxes of the environment tier, reset in place between instances (default: a fresh sandbox "
        "of the instance image for each)",
    )


def add_validate_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `swe-validate`."""
    p.add_argument("--dataset", required=True, type=Path)
    p.add_argument("--k", type=int, default=3, help="gold runs per instance")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--log-dir", type=Path, default=Path("logs/swe-validate"))
    p.add_argument("--run-id", default=None, help="default: a new one from the time")
    p.add_argument("--out", type=Path, help="write the validated dataset (flaky tests quarantined) here")
    p.add_argument("--owner", default="envfleet-swe-validate", help="owner label of the sandboxes")


def add_build_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `swe-build`."""
    from environments.swe.builder.pins import INSTANCES, PINS

    p.add_argument("--pins", type=Path, default=PINS, help="pinned projects (JSON)")
    p.add_argument("--out", type=Path, default=INSTANCES, help="where the instances go (JSONL)")
    p.add_argument("--projects", nargs="*", help="only these packages")
    p.add_argument("--per-project", type=int, default=None, help="instances per project (default: the pins')")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--max-pass-to-pass",
        type=_at_least_one,
        default=None,
        help="a seeded sample of at most this many PASS_TO_PASS tests per instance (default: every one, as SWE-bench)",
    )
    p.add_argument("--validate-runs", type=int, default=1, help="gold runs through the harness before shipping")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--log-dir", type=Path, default=Path("logs/swe-build"))
    p.add_argument("--owner", default="envfleet-swe-build", help="owner label of the sandboxes")


@asynccontextmanager
async def _backend(owner: str) -> AsyncIterator[DockerBackend]:
    from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig

    backend = await DockerBackend.start(DockerBackendConfig(owner=owner))
    try:
        yield backend
    finally:
        await backend.close()


def _progress(console: Console) -> Progress:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("resolved {task.fields[resolved]}  errors {task.fields[errors]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def swe_eval(args: argparse.Namespace, console: Console) -> int:
    """Evaluate predictions; print `resolved N%`. Exit 2 on invalid input."""
    import docker

    from environments.swe.evaluate import run_evaluation
    from environments.swe.instance import empty_predictions, gold_predictions, load_instances, load_predictions
    from orchestrator.core.errors import EnvfleetError

    try:
        instances = load_instances(args.dataset)
        if str(args.predictions) in ("gold", "empty") and not args.predictions.exists():
            make = gold_predictions if str(args.predictions) == "gold" else empty_predictions
            preds = make(instances)
        else:
            preds = load_predictions(args.predictions, instances)
    except EnvfleetError as e:
        console.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
        return 2
    if args.instance_ids:
        wanted = set(args.instance_ids)
        preds = [p for p in preds if p.instance_id in wanted]

    async def go() -> dict[str, object]:
        with _progress(console) as bar:
            counts = {"resolved": 0, "errors": 0}
            task = bar.add_task("swe-eval", total=len(preds), resolved=0, errors=0)

            def on_done(instance_id: str, outcome: str) -> None:
                counts["resolved"] += outcome == "resolved"
                counts["errors"] += outcome == "error"
                bar.update(task, advance=1, resolved=counts["resolved"], errors=counts["errors"])

            async with _backend(args.owner) as backend:
                return await run_evaluation(
                    instances,
                    preds,
                    run_id=args.run_id,
                    backend=backend,
                    client=docker.from_env(),
                    workers=args.workers,
                    log_dir=args.log_dir,
                    timeout_s=args.timeout,
                    progress=on_done,
                    reuse_sandboxes=args.reuse_sandboxes,
                )

    summary = asyncio.run(go())
    run_dir = args.log_dir / args.run_id
    console.print(
        f"{summary['completed_instances']} evaluated ({len(summary['skipped_ids'])} from an earlier run), "  # type: ignore[arg-type]
        f"{summary['error_instances']} errors; report: {run_dir / 'summary.json'}",
        highlight=False,
    )
    errors = summary["errors"]
    assert isinstance(errors, dict)
    for iid, msg in list(errors.items())[:10]:
        console.print(f"  [red]error[/red] {iid}: {msg}", highlight=False)
    console.print(f"resolved {summary['resolved_percent']:g}%", highlight=False)
    return 0 if not errors else 1


def swe_validate(args: argparse.Namespace, console: Console) -> int:
    """Gold k of k, empty none, flaky tests quarantined; exit 1 when anything needed quarantine or is invalid."""
    import docker

    from environments.swe.instance import dump_jsonl, load_instances
    from environments.swe.validate import validate_dataset
    from orchestrator.core.errors import EnvfleetError

    try:
        instances = load_instances(args.dataset)
    except EnvfleetError as e:
        console.print(f"[red]error:[/red] {e}", highlight=False)
        return 2
    run_id = args.run_id or time.strftime("validate-%Y%m%d-%H%M%S")

    async def go() -> object:
        with _progress(console) as bar:
            counts = {"resolved": 0, "errors": 0}
            task = bar.add_task("swe-validate", total=len(instances) * (args.k + 1), resolved=0, errors=0)

            def on_done(instance_id: str, outcome: str) -> None:
                counts["resolved"] += outcome == "resolved"
                counts["errors"] += outcome == "error"
                bar.update(task, advance=1, resolved=counts["resolved"], errors=counts["errors"])

            async with _backend(args.owner) as backend:
                return await validate_dataset(
                    instances,
                    backend=backend,
                    client=docker.from_env(),
                    runs=args.k,
                    workers=args.workers,
                    log_dir=args.log_dir,
                    run_id=run_id,
                    progress=on_done,
                )

    from environments.swe.validate import ValidationResult

    result = asyncio.run(go())
    assert isinstance(result, ValidationResult)
    report = result.report()
    path = args.log_dir / f"{run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    for iid, tests in report["quarantined"].items():
        console.print(f"  quarantined in {iid}: {tests}", highlight=False)
    for iid in report["invalid"]:
        console.print(f"  [red]invalid[/red] {iid}: {report['instances'][iid]}", highlight=False)
    if args.out:
        dump_jsonl(result.instances, args.out)
        console.print(f"validated dataset: {args.out} ({len(result.instances)} instances)", highlight=False)
    console.print(
        f"{report['valid']}/{len(instances)} valid: gold resolves {args.k}/{args.k}, empty resolves none; "
        f"{len(report['quarantined'])} with quarantined tests; report {path}",
        highlight=False,
    )
    return 0 if result.ok else 1


def swe_build(args: argparse.Namespace, console: Console) -> int:
    """Build the dataset from the pins and write it (plus the pins next to it)."""
    import docker

    from environments.swe.builder.build import SEED, BuildOptions, build_dataset
    from environments.swe.builder.pins import load_pins
    from environments.swe.instance import dump_jsonl

    pins = load_pins(args.pins)
    if args.projects:
        pins = [p for p in pins if p.package in set(args.projects)]
        if not pins:
            console.print(f"[red]error:[/red] none of {args.projects} is in {args.pins}", highlight=False)
            return 2
    options = BuildOptions(
        seed=args.seed if args.seed is not None else SEED,
        workers=args.workers,
        validate_runs=args.validate_runs,
        max_pass_to_pass=args.max_pass_to_pass,
        instances_per_project=args.per_project,
    )

    async def go() -> tuple[list[object], list[object]]:
        async with _backend(args.owner) as backend:
            instances, stats = await build_dataset(
                pins,
                backend=backend,
                client=docker.from_env(),
                options=options,
                log_dir=args.log_dir,
                progress=lambda msg: console.print(msg, highlight=False),
            )
            return list(instances), list(stats)

    t0 = time.monotonic()
    instances, stats = asyncio.run(go())
    from environments.swe.builder.build import ProjectStats
    from environments.swe.instance import SweInstance

    shipped = [i for i in instances if isinstance(i, SweInstance)]
    dump_jsonl(shipped, args.out)
    for s in stats:
        assert isinstance(s, ProjectStats)
        console.print(
            f"{s.package}: {s.shipped} shipped; {s.tried} mutants tried, {s.killed} caught by tests, "
            f"{s.passing_tests} passing tests; rejected {s.reasons}; {s.seconds:.0f}s",
            highlight=False,
        )
    console.print(f"{len(shipped)} instances -> {args.out} in {time.monotonic() - t0:.0f}s", highlight=False)
    return 0 if shipped else 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `envfleet.cli` entry point: adds swe-eval, swe-validate and swe-build to the `envfleet` command."""

    def runner(fn: Callable[[argparse.Namespace, Console], int]) -> Callable[[argparse.Namespace], int]:
        def run(args: argparse.Namespace) -> int:
            from orchestrator.cli.main import terminal_console

            return fn(args, terminal_console())

        return run

    swe_eval_p = sub.add_parser("swe-eval", help="evaluate SWE-bench predictions on the fleet; report per instance")
    add_eval_arguments(swe_eval_p)
    swe_eval_p.set_defaults(fn=runner(swe_eval))
    swe_validate_p = sub.add_parser("swe-validate", help="check a SWE dataset: gold resolves k of k, empty none")
    add_validate_arguments(swe_validate_p)
    swe_validate_p.set_defaults(fn=runner(swe_validate))
    swe_build_p = sub.add_parser("swe-build", help="build the SWE dataset from pinned PyPI sdists (mutants)")
    add_build_arguments(swe_build_p)
    swe_build_p.set_defaults(fn=runner(swe_build))
