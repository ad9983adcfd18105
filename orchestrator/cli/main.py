"""The `envfleet` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import docker
import docker.errors
import grpc
from rich.console import Console
from rich.table import Table

from orchestrator.cli.config import add_config_argument, add_version_argument, parse_args
from orchestrator.cli.envs import add_envs_commands
from orchestrator.cli.errors import CommandLineError
from orchestrator.cli.log_format import add_log_format_argument, configure_logging
from orchestrator.cli.remote import (
    add_client_arguments,
    add_serve_security_arguments,
    connect,
    orchestrator_client,
    rpc_error_message,
)
from orchestrator.core.errors import EnvfleetError
from orchestrator.core.metrics import DEFAULT_METRICS_PORT
from orchestrator.core.models import DEFAULT_JOB_RETENTION_S, JobStatus
from orchestrator.core.processes import usable_cpus


def terminal_console() -> Console:
    """The console every command prints with: the terminal's width, or 150 columns into a pipe or file."""
    return Console(width=None if sys.stdout.isatty() else 150)


console = terminal_console()


def _cmd_image_build_base(args: argparse.Namespace) -> int:
    from orchestrator.images import ensure_base_image

    print(ensure_base_image(docker.from_env()))
    return 0


def _cmd_image_build_orchestrator(args: argparse.Namespace) -> int:
    from orchestrator.images.orchestrator_image import ensure_orchestrator_image

    print(ensure_orchestrator_image(docker.from_env(), extra_wheels=args.extra_wheels))
    return 0


def _cmd_sandbox_demo(args: argparse.Namespace) -> int:
    from orchestrator.cli.sandbox_demo import run_demo
    from orchestrator.images import ensure_base_image

    image = args.image or ensure_base_image(docker.from_env())
    asyncio.run(run_demo(image, console))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from orchestrator.testing.demo import run_job_demo

    return asyncio.run(run_job_demo(console, Path(args.out), args.tasks, args.n))


def _cmd_sweep(args: argparse.Namespace) -> int:
    from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig

    async def go() -> int:
        config = DockerBackendConfig(owner="envfleet-sweep")
        if args.socket_root is not None:  # the sandboxes' seals are checked with that root's key
            config = config.model_copy(update={"socket_root": args.socket_root})
        backend = await DockerBackend.start(config, sweep=False)
        try:
            return await backend.sweep(older_than=args.older_than)
        finally:
            await backend.close()

    print(f"removed {asyncio.run(go())} sandbox(es)")
    return 0


def _backend_config(args: argparse.Namespace) -> object:
    """The --backend's config: --backend-config's settings (a YAML or JSON mapping), the owner, the type."""
    import yaml

    from orchestrator.backends.config import parse_backend_config
    from orchestrator.core.errors import ConfigError

    raw: dict[str, object] = {}
    if args.backend_config:
        try:
            loaded = yaml.safe_load(Path(args.backend_config).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"backend config {args.backend_config}: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"backend config {args.backend_config}: expected a mapping of settings")
        raw = loaded
    settings = {"owner": args.owner, **raw}
    if args.socket_root:
        settings["socket_root"] = args.socket_root
    if args.runtime:
        if args.backend != "docker":
            raise ConfigError("--runtime is an OCI runtime of the docker backend; the fake backend has none")
        settings["runtime"] = args.runtime
    if settings.setdefault("type", args.backend) != args.backend:
        raise ConfigError(f"backend config says type {settings['type']!r} but --backend is {args.backend!r}")
    return parse_backend_config(settings)


def _server_config(args: argparse.Namespace) -> object:
    from orchestrator.cli.openenv import openenv_settings
    from orchestrator.cli.remote import security_config, worker_tls_config
    from orchestrator.cli.view import ui_settings
    from orchestrator.core.errors import ConfigError
    from orchestrator.core.tracing import TracingConfig
    from orchestrator.server.app import OrchestratorConfig
    from orchestrator.worker.ray_fleet import RayConfig

    # the config file's sections no flag sets (cli/config.py SERVE_SECTIONS), validated with the rest
    settings: dict[str, Any] = dict(getattr(args, "settings", {}))
    sessions = settings.pop("sessions", {})
    if not isinstance(sessions, dict):
        raise ConfigError("sessions: expected a mapping of session settings (max_per_tenant, ...)")
    if "idle_ttl_s" in sessions:
        raise ConfigError("sessions.idle_ttl_s: set it with session-ttl (the flag, its variable or its key)")
    return OrchestratorConfig(
        host=args.host,
        port=args.port,
        data_dir=Path(args.data_dir),
        max_in_flight=args.max_in_flight,
        job_retention_s=None if args.job_retention_s < 0 else args.job_retention_s,
        result_log_sync=args.result_log_sync,
        result_log_acked=args.result_log_acked,
        backend=_backend_config(args),
        security=security_config(args),
        reflection=args.reflection,
        sessions={**sessions, "idle_ttl_s": args.session_ttl},
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        workers=args.workers if args.workers is not None else (0 if args.ray_address else usable_cpus()),
        worker_listen=args.worker_listen,
        worker_token_file=Path(args.worker_token_file) if args.worker_token_file else None,
        worker_tls=worker_tls_config(args),
        ray=RayConfig(address=args.ray_address, resource=args.ray_resource, per_node=args.ray_workers_per_node)
        if args.ray_address
        else None,
        metrics_host=args.metrics_host,
        tracing=TracingConfig(
            otlp_endpoint=args.otlp_endpoint or None,
            otlp_protocol=args.otlp_protocol,
            otlp_sample_ratio=args.otlp_sample_ratio,
        ),
        tokenizer_dirs=args.tokenizer_dir or [],
        **ui_settings(args),
        **openenv_settings(args),
        **settings,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from orchestrator.core.errors import ConfigError
    from orchestrator.core.runtime import limit_malloc_arenas, tune_gc
    from orchestrator.server.app import OrchestratorConfig, create_server
    from orchestrator.server.convert import validation_message

    limit_malloc_arenas()  # before gRPC starts its threads

    async def go() -> None:
        try:
            config = _server_config(args)
            assert isinstance(config, OrchestratorConfig)
            orch = await create_server(config)
        except ValidationError as e:  # flags that do not fit together: one line, no traceback
            raise SystemExit(f"envfleet serve: {validation_message(e)}") from None
        except ConfigError as e:
            raise SystemExit(f"envfleet serve: {e}") from None
        except OSError as e:  # a file a flag names that cannot be read (a token file, a TLS key): one line
            raise SystemExit(f"envfleet serve: {e.strerror or e}: {e.filename or ''}".rstrip(": ")) from None
        tune_gc()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"listening {orch.address}", flush=True)
        if orch.metrics_port is not None:
            print(f"metrics http://{config.metrics_host}:{orch.metrics_port}/metrics", flush=True)
        if orch.ui is not None:
            print(f"ui {orch.ui.url}/", flush=True)
        if orch.openenv is not None:
            print(f"openenv {orch.openenv.url}/envs/", flush=True)
        try:
            await stop.wait()
        finally:
            # a second signal ends the process at once: a stop that waits on a wedged engine (a removal a call of up
            # to api_timeout_s, one at a time) ignored every further SIGTERM and Ctrl-C until a SIGKILL; the
            # result log is crash-safe, the data directory's lock goes with the process, and this instance's
            # reaper removes its sandboxes once it is gone
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, _exit_now, 128 + sig)
            await orch.stop()
        # stopped: nothing more to wait for. asyncio.run would join the default executor's threads, and an image
        # build in one (minutes, bounded only by the engine's read timeout) held the exit that long
        _exit_now(0)

    asyncio.run(go())
    return 0


def _exit_now(code: int) -> None:
    """End the process now, output flushed, without joining its threads."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cmd_scripted_policy(args: argparse.Namespace) -> int:
    from orchestrator.service.registry import Registry
    from orchestrator.testing.scripted_policy import _serve
    from orchestrator.testing.scripts import reference_script

    env = Registry.from_entry_points().get(args.env)
    script = reference_script(env, mode=args.mode, latency_s=args.latency)
    args.no_tokens = False
    asyncio.run(_serve(args, script))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import httpx

    from orchestrator.cli.status import fetch_status, metrics_url, render_status

    url = args.metrics or metrics_url(args.server, DEFAULT_METRICS_PORT)
    try:
        samples = fetch_status(url)
    except httpx.HTTPError as e:
        hint = "is the server's --metrics-port on? name the page with --metrics URL"
        print(f"envfleet: cannot read the metrics at {url}: {e} ({hint})", file=sys.stderr)
        return 1

    async def go() -> list[JobStatus]:
        async with connect(args) as client:
            return await client.list_jobs()

    jobs = asyncio.run(go())
    console.print(render_status(samples))
    console.print(_jobs_table(jobs, f"jobs on {args.server}"))
    return 0


def _jobs_table(jobs: list[JobStatus], title: str) -> Table:
    table = Table("job", "env", "state", "done/total", "by status", "rollouts/s", title=title)
    for j in jobs:
        table.add_row(
            j.job_id,
            j.env,
            j.state.value,
            f"{j.done}/{j.total}",
            ", ".join(f"{k}={v}" for k, v in sorted(j.by_status.items())),
            f"{j.rollouts_per_s:.2f}",
        )
    return table


def _cmd_jobs(args: argparse.Namespace) -> int:
    async def go() -> list[JobStatus]:
        async with connect(args) as client:
            return await client.list_jobs()

    console.print(_jobs_table(asyncio.run(go()), f"jobs on {args.server}"))
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    async def go() -> JobStatus:
        async with connect(args) as client:
            return await client.cancel_job(args.job_id)

    status = asyncio.run(go())
    print(f"job {status.job_id} {status.state.value}: {status.done} of {status.total} rollouts done")
    return 0


def _add_tokenizer_dir_argument(p: argparse.ArgumentParser, where: str = "") -> None:
    p.add_argument(
        "--tokenizer-dir",
        action="append",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"a directory of tokenizers, one folder each, that tito jobs name (repeatable){where}",
    )


def _cmd_rollout(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from orchestrator.core.models import JobSpec, TaskSelection
    from orchestrator.core.policy import PolicyEndpoint
    from orchestrator.server.convert import validation_message
    from orchestrator.testing.demo import collect_rollouts

    try:
        spec = JobSpec(
            env=args.env,
            tasks=TaskSelection(kind="sample", count=args.tasks, seed=args.seed) if args.tasks else TaskSelection(),
            group_size=args.n,
            policy=PolicyEndpoint(
                base_url=args.policy,
                model=args.model,
                api_key=args.api_key,
                tokenizer=args.tokenizer,
                tool_parser=args.tool_parser,
                stream=args.stream,
                outage_wait_s=args.outage_wait,
            ),
            max_concurrency=args.concurrency,
            max_turns=args.max_turns,
            token_mode=args.token_mode,
            max_model_len=args.max_model_len,
        )
    except ValidationError as e:
        raise CommandLineError(f"envfleet rollout: {validation_message(e)}") from None

    async def go() -> int:
        async with orchestrator_client(args) as client:
            return await collect_rollouts(client, spec, Path(args.out), console)

    return asyncio.run(go())


log = logging.getLogger(__name__)

PLUGIN_COMMANDS_GROUP = "envfleet.cli"


def add_plugin_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Subcommands that installed plug-ins add: each entry point of the `envfleet.cli` group is a function that
    takes the subparsers and adds its commands (with `set_defaults(fn=...)`)."""
    for ep in sorted(entry_points(group=PLUGIN_COMMANDS_GROUP), key=lambda e: e.name):
        ep.load()(sub)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from orchestrator.cli.openenv import add_openenv_arguments, add_openenv_command
    from orchestrator.cli.view import add_ui_arguments, add_view_command

    p = argparse.ArgumentParser(
        prog="envfleet", description="A sandboxed agent-environment fleet for RL rollouts.", allow_abbrev=False
    )
    p.add_argument("-v", "--verbose", action="count", default=0)
    add_version_argument(p)
    add_log_format_argument(p)
    sub = p.add_subparsers(dest="command", required=True)

    # no abbreviations: the config file is found before the parse, by --config's whole name (cli/config.py)
    serve = sub.add_parser("serve", help="run the orchestrator's gRPC server", allow_abbrev=False)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--data-dir", default=".envfleet", help="where the result log lives")
    serve.add_argument("--max-in-flight", type=int, default=64, help="rollouts in flight on this host")
    serve.add_argument("--owner", default="envfleet-orchestrator", help="owner label of its sandboxes")
    serve.add_argument(
        "--job-retention-s",
        type=float,
        default=DEFAULT_JOB_RETENTION_S,
        help="a finished job and its rollouts are removed from the result log this long after its end; -1: kept",
    )
    serve.add_argument(
        "--result-log-sync",
        choices=["full", "normal"],
        default="full",
        help="full: each rollout is on disk (fsync) before it is streamed, so a power loss loses none a trainer saw; "
        "normal: it survives a crash of the server, not of the host, for 10-15%% more rollouts/s at the top rate",
    )
    serve.add_argument(
        "--result-log-acked",
        choices=["keep", "slim"],
        default="keep",
        help="keep: an acked rollout stays whole for the job's retention; slim: its turns and tokens go at the ack "
        "(its status, reward, metrics and timing stay), for jobs that run for weeks",
    )
    add_ui_arguments(serve)
    add_openenv_arguments(serve)
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="rollout worker processes on this host (default: one per core it may use, or none with --ray-address); "
        "0 runs rollouts in the server process",
    )
    serve.add_argument(
        "--worker-listen",
        default=None,
        help="also accept remote workers (Ray actors) at HOST:PORT; TLS with --tls-cert (else loopback or --insecure)",
    )
    serve.add_argument(
        "--worker-token-file",
        default=None,
        help="the workers' token, a 0600 file (default: kept in the data dir when --worker-listen is set)",
    )
    serve.add_argument("--ray-address", default=None, help="join this Ray cluster (auto, or HOST:PORT of its head)")
    serve.add_argument("--ray-resource", default="envfleet_sandbox_host", help="the custom resource of sandbox hosts")
    serve.add_argument("--ray-workers-per-node", type=int, default=1, help="worker actors per sandbox host")
    serve.add_argument(
        "--backend", choices=["docker", "fake"], default="docker", help="docker; or fake (in-process, for tests)"
    )
    serve.add_argument("--backend-config", help="a YAML or JSON file of the backend's settings")
    serve.add_argument(
        "--socket-root", type=Path, default=None, help="envd's socket folders (in a container: the host's same path)"
    )
    serve.add_argument(
        "--runtime",
        default="",
        help="OCI runtime of sandboxes that name none (runsc: gVisor; the engine must have it registered)",
    )
    serve.add_argument(
        "--metrics-port", type=int, default=DEFAULT_METRICS_PORT, help="Prometheus endpoint port; -1: off"
    )
    serve.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="where the metrics endpoint listens; it has no authentication, so loopback by default",
    )
    serve.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="export an OpenTelemetry trace of every rollout here (grpc: HOST:PORT; http: http://HOST:PORT); "
        "default off, and OpenTelemetry is not even imported",
    )
    serve.add_argument("--otlp-protocol", choices=["grpc", "http"], default="grpc", help="OTLP over gRPC or HTTP")
    serve.add_argument(
        "--otlp-sample-ratio",
        type=float,
        default=1.0,
        metavar="R",
        help="trace this share of rollouts (0..1, by trace id; workers follow the control plane's choice)",
    )
    _add_tokenizer_dir_argument(serve)
    add_serve_security_arguments(serve)
    add_config_argument(serve)
    serve.set_defaults(fn=_cmd_serve)

    add_envs_commands(sub, console)
    add_view_command(sub)
    add_openenv_command(sub)

    rollout = sub.add_parser("rollout", help="run rollouts and write them as JSONL")
    rollout.add_argument("--env", required=True)
    rollout.add_argument("--n", type=int, default=1, help="samples per task")
    rollout.add_argument("--tasks", type=int, default=0, help="sample this many tasks (default: all)")
    rollout.add_argument("--seed", type=int, default=0)
    rollout.add_argument("--policy", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    rollout.add_argument("--model", default="policy")
    rollout.add_argument("--api-key", default="")
    rollout.add_argument("--concurrency", type=int, default=8)
    rollout.add_argument(
        "--max-turns", type=int, default=0, help="at most this many turns (default 0: the environment's own limit)"
    )
    rollout.add_argument("--out", default="rollouts.jsonl")
    rollout.add_argument(
        "--token-mode",
        choices=["chat", "tito"],
        default=None,
        help="tito: token ids to /v1/completions, sampled ids kept exactly; chat: /v1/chat/completions "
        "(default: tito when --tokenizer is given)",
    )
    rollout.add_argument(
        "--tokenizer", default="", help="the model's tokenizer: a folder name in the server's --tokenizer-dir"
    )
    rollout.add_argument(
        "--tool-parser",
        default="hermes",
        help="tito's tool-call format: hermes, qwen3_coder, llama3_json, or a plug-in",
    )
    rollout.add_argument("--max-model-len", type=int, default=None, help="tito: the whole episode's context in tokens")
    rollout.add_argument(
        "--stream",
        action="store_true",
        help="ask the policy server for streamed answers: a generation may run past the request timeout while it "
        "keeps sending",
    )
    rollout.add_argument(
        "--outage-wait",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long a rollout waits out its policy server down or busy (refused, 429, 502, 503, aborted) once its "
        "retries are spent, none of it the rollout's time (default 300; 0: a POLICY_ERROR at once)",
    )
    _add_tokenizer_dir_argument(rollout, " (of the in-process orchestrator, without --server)")
    add_client_arguments(rollout, None, "an orchestrator address (default: run one in this process)")
    rollout.set_defaults(fn=_cmd_rollout)

    status = sub.add_parser(
        "status", help="an orchestrator's fleet (sandboxes, pools, queue, rollouts, latencies) and your jobs"
    )
    status.add_argument(
        "--metrics", default=None, help=f"the server's metrics URL (default: port {DEFAULT_METRICS_PORT} of its host)"
    )
    add_client_arguments(status)
    status.set_defaults(fn=_cmd_status)

    jobs = sub.add_parser("jobs", help="list an orchestrator's jobs (your tenant's, with a token)")
    add_client_arguments(jobs)
    jobs.set_defaults(fn=_cmd_jobs)

    cancel = sub.add_parser("cancel", help="cancel a job: queued rollouts never run, running ones are stopped")
    cancel.add_argument("job_id")
    add_client_arguments(cancel)
    cancel.set_defaults(fn=_cmd_cancel)

    demo = sub.add_parser("demo", help="orchestrator + scripted policy + a job of scored rollouts, end to end")
    demo.add_argument("--out", default="demo-rollouts.jsonl")
    demo.add_argument("--tasks", type=int, default=8)
    demo.add_argument("--n", type=int, default=2)
    demo.set_defaults(fn=_cmd_demo)

    sandbox_demo = sub.add_parser("sandbox-demo", help="drive one hardened sandbox through envd and show timings")
    sandbox_demo.add_argument("--image", help="sandbox image (default: the base image)")
    sandbox_demo.set_defaults(fn=_cmd_sandbox_demo)

    scripted = sub.add_parser("scripted-policy", help="serve a scripted policy that replays reference solutions")
    scripted.add_argument("--env", required=True)
    scripted.add_argument("--mode", choices=["solve", "wrong", "empty"], default="solve")
    scripted.add_argument("--latency", type=float, default=0.0, help="seconds per completion")
    scripted.add_argument("--host", default="127.0.0.1")
    scripted.add_argument("--port", type=int, default=0)
    scripted.set_defaults(fn=_cmd_scripted_policy)

    image = sub.add_parser("image", help="build images offline").add_subparsers(dest="image_command", required=True)
    image.add_parser("build-base", help="build (or reuse) the envd base image").set_defaults(fn=_cmd_image_build_base)
    orchestrator_image = image.add_parser("build-orchestrator", help="build the orchestrator's own image")
    orchestrator_image.add_argument(
        "--extra-wheels", type=Path, default=None, help="a folder of plug-in wheels (*.whl) to install next to envfleet"
    )
    orchestrator_image.set_defaults(fn=_cmd_image_build_orchestrator)

    sweep = sub.add_parser("sweep", help="remove sandboxes of dead owners and expired leases")
    sweep.add_argument("--older-than", type=float, default=None, help="also remove any sandbox older than N seconds")
    sweep.add_argument(
        "--socket-root",
        type=Path,
        default=None,
        help="the socket folders of the server whose sandboxes to sweep (deploy/run.sh: /run/envfleet-orchestrator); "
        "only that server's sandboxes carry seals its key verifies",
    )
    sweep.set_defaults(fn=_cmd_sweep)

    add_plugin_commands(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `envfleet` console script."""
    args = parse_args(build_parser(), argv)  # options also from ENVFLEET_* and --config (cli/config.py)
    configure_logging(args.verbose, args.log_format)
    try:
        code = args.fn(args)
    except KeyboardInterrupt:
        code = 130
    except grpc.RpcError as e:  # the server's answer, or no server: one line, no traceback (-vv logs it)
        log.debug("call failed", exc_info=True)
        print(f"envfleet: {rpc_error_message(e, getattr(args, 'server', None))}", file=sys.stderr)
        code = 1
    except EnvfleetError as e:
        log.debug("command failed", exc_info=True)
        print(f"envfleet: error: {e}", file=sys.stderr)
        code = 2 if isinstance(e, CommandLineError) else 1
    except docker.errors.DockerException as e:  # no engine (a fresh machine), or its refusal: one line
        log.debug("engine call failed", exc_info=True)
        if isinstance(e, docker.errors.APIError):
            print(f"envfleet: the Docker engine refused: {e}", file=sys.stderr)
        else:
            print(
                f"envfleet: cannot reach the Docker engine ({e}); start it (`make docker` in a checkout) or set "
                "DOCKER_HOST",
                file=sys.stderr,
            )
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
