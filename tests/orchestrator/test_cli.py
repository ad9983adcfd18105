"""The command line and the sync client, as a user runs them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import build_parser
from orchestrator.client.sdk import EnvfleetClient, SyncEnvfleetClient
from orchestrator.core.policy import REPLAY_URL as REPLAY
from orchestrator.server.app import Orchestrator
from orchestrator.testing.scripted_policy import ScriptedServer
from tests.conftest import REPO
from tests.orchestrator.conftest import job
from tests.orchestrator.servers import FAKE, serve, silent_policy

CLIENT_FLAGS = ("--server", "--token-file", "--tls-ca", "--tls-cert", "--tls-key", "--insecure")
# Commands that never talk to an orchestrator, and why. A new command must be added here or take CLIENT_FLAGS.
LOCAL_ONLY = {
    "serve": "is the server; its --token-file/--tls-* flags configure it",
    "demo": "starts its own orchestrator and scripted policy, end to end (make demo)",
    "sandbox-demo": "drives one sandbox through envd on this host's Docker",
    "scripted-policy": "is a policy server, which orchestrators call",
    "image build-base": "builds an image on this host's Docker",
    "image build-orchestrator": "builds an image on this host's Docker",
    "sweep": "removes this host's leftover containers",
    "view": "browses a local file of rollouts; a live server shows its own with serve --ui-port",
    "swe-eval": "runs on this host's Docker; the API has no evaluation call",
    "swe-validate": "runs on this host's Docker; the API has no evaluation call",
    "swe-build": "runs on this host's Docker; the API has no evaluation call",
}
SHELL_GRADER = (
    "python3 -c 'import json, sys; e = json.load(sys.stdin); "
    'print(json.dumps({"reward": float(e["answer"] == e["data"]["word"])}))\''
)


def _envfleet(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_envs_list_and_describe() -> None:
    r = _envfleet("envs", "list")
    assert r.returncode == 0 and "python-tool@1" in r.stdout
    r = _envfleet("envs", "describe", "python-tool")
    assert r.returncode == 0 and "tool python" in r.stdout and "py-000" in r.stdout
    r = _envfleet("envs", "describe", "pyton-tool")
    assert r.returncode != 0 and "did you mean python-tool" in r.stderr


@pytest.mark.parametrize("stream", [False, True])
async def test_rollout_command_writes_jsonl(
    tmp_path: Path, policy_server: ScriptedServer, base_image: str, stream: bool
) -> None:
    out = tmp_path / "r.jsonl"
    streamed = policy_server.app.streamed
    args = ["--env", "python-tool", "--tasks", "2", "--n", "2", "--policy", policy_server.url, "--out", str(out)]
    r = await asyncio.to_thread(_envfleet, "rollout", *args, *(["--stream"] if stream else []))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 4
    assert {x["status"] for x in lines} == {"OK"} and {x["reward"] for x in lines} == {1.0}
    assert {x["tokens"]["status"] for x in lines} == {"complete"}
    assert "4 rollouts written" in r.stdout
    assert (policy_server.app.streamed > streamed) == stream  # every answer came as a stream, or none did


async def test_sync_client(fake_orchestrator: Orchestrator, policy_server: ScriptedServer, task_ids: list[str]) -> None:
    orchestrator = fake_orchestrator

    def run() -> list[str]:
        with SyncEnvfleetClient(orchestrator.address) as c:
            job_id = c.submit(job(policy_server.url, task_ids[:3]))
            got = [r.task_id for r in c.rollouts(job_id)]
            assert c.get_job(job_id).acked == 3
            again = c.submit(job(policy_server.url, task_ids[:3]))
            assert sorted(m.task_id for m in c.rollout_messages(again)) == sorted(got)
            assert c.get_job(again).acked == 3
            return got

    assert sorted(await asyncio.to_thread(run)) == sorted(task_ids[:3])


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, set[str]]]:
    """Every leaf command of the parser, with the option strings it accepts."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(path), {o for a in parser._actions for o in a.option_strings}
        return
    for name, child in subs[0].choices.items():
        yield from _commands(child, (*path, name))


def test_every_command_that_can_reach_a_server_takes_the_client_flags() -> None:
    commands = dict(_commands(build_parser()))
    assert set(LOCAL_ONLY) <= set(commands), f"stale entries: {set(LOCAL_ONLY) - set(commands)}"
    remote = {name for name in commands if name not in LOCAL_ONLY}
    assert {"envs list", "envs describe", "envs validate", "envs register", "jobs", "rollout", "status"} <= remote
    for name in sorted(remote):
        missing = [f for f in CLIENT_FLAGS if f not in commands[name]]
        assert not missing, f"`envfleet {name}` lacks {missing}: add_client_arguments(), or LOCAL_ONLY with a reason"
    for name in LOCAL_ONLY:
        assert "--server" not in commands[name], f"`envfleet {name}` takes --server: classify it as a client command"
    flags = ["--server", "h:1", "--token-file", "t", "--tls-ca", "a", "--tls-cert", "b", "--tls-key", "k", "--insecure"]
    args = build_parser().parse_args(["envs", "list", *flags])  # refused before: "unrecognized arguments"
    assert (args.server, args.token_file, args.tls_ca, args.tls_cert, args.tls_key, args.insecure) == (
        "h:1",
        "t",
        "a",
        "b",
        "k",
        True,
    )


def _echo_spec(folder: Path, typo_in: int | None = None, references: bool = True) -> Path:
    """A declarative spec as a user writes it: YAML, a JSONL task file, a shell grader; `typo_in`: that task's data
    misspells the key the grader reads."""
    tasks = [
        {
            "id": f"echo-{i}",
            "prompt": f"Submit the word w{i}.",
            "data": {"wrod" if i == typo_in else "word": f"w{i}"},
            "reference": [{"name": "submit", "arguments": {"answer": f"w{i}"}}] if references else [],
        }
        for i in range(2)
    ]
    (folder / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    spec = {
        "name": "cli-echo",
        "version": "0.2",
        "description": "echo a word",
        "tools": ["submit"],
        "tasks_file": "tasks.jsonl",
        "scoring": {"command": SHELL_GRADER},
        "limits": {"memory_mb": 128},
    }
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    return folder / "spec.yaml"


async def test_envs_commands_over_a_server(client: EnvfleetClient, tmp_path: Path) -> None:
    """validate, register, list and describe with --server answer for the server, not the local registry."""
    spec = str(_echo_spec(tmp_path))
    addr = client.target
    r = await asyncio.to_thread(_envfleet, "envs", "validate", spec, "--server", addr)
    assert r.returncode == 0 and "cli-echo@0.2 is valid" in r.stdout, r.stderr
    assert "cli-echo" not in [e.name for e in await client.list_envs()]
    r = await asyncio.to_thread(_envfleet, "envs", "register", spec, "--server", addr)
    assert r.returncode == 0 and "registered cli-echo@0.2: 2 task(s)" in r.stdout, r.stderr

    r = await asyncio.to_thread(_envfleet, "envs", "list", "--server", addr)
    assert r.returncode == 0, r.stderr
    assert f"environments on {addr}" in r.stdout
    assert "cli-echo@0.2" in r.stdout and "python-tool@1" in r.stdout
    local = await asyncio.to_thread(_envfleet, "envs", "list")
    assert local.returncode == 0 and "python-tool@1" in local.stdout and "cli-echo" not in local.stdout

    r = await asyncio.to_thread(_envfleet, "envs", "describe", "cli-echo", "--server", addr)
    assert r.returncode == 0 and "cli-echo@0.2" in r.stdout and "echo a word" in r.stdout, r.stderr
    assert "source: spec; tasks: 2" in r.stdout and "tool submit" in r.stdout
    r = await asyncio.to_thread(_envfleet, "envs", "describe", "cli-ech", "--server", addr)
    assert r.returncode == 1 and f"{addr} answered NOT_FOUND" in r.stderr and "cli-echo" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

    r = await asyncio.to_thread(_envfleet, "envs", "validate", "python-tool", "--server", addr)
    assert r.returncode == 2 and "'python-tool' is not a spec file" in r.stderr and "without --server" in r.stderr


async def test_envs_validate_a_spec_without_a_server(tmp_path: Path, base_image: str) -> None:
    """No --server: the spec is validated by an orchestrator started in the command's own process, and then every
    task is checked as a plug-in's are (Validate runs one task's reference: a grader that failed on another task's
    data passed, and scored the policy 0 there)."""
    r = await asyncio.to_thread(_envfleet, "envs", "validate", str(_echo_spec(tmp_path)))
    assert r.returncode == 0 and "cli-echo@0.2 is valid" in r.stdout, r.stderr
    assert "cli-echo@0.2: ok; 2 tasks checked" in r.stdout, r.stdout
    (tmp_path / "typo").mkdir()
    r = await asyncio.to_thread(_envfleet, "envs", "validate", str(_echo_spec(tmp_path / "typo", typo_in=1)))
    assert r.returncode == 1 and "cli-echo@0.2 is valid" in r.stdout, r.stderr
    assert "problem task echo-1: ENV_ERROR: ScoringError" in r.stdout and "KeyError: 'word'" in r.stdout, r.stdout
    assert "cli-echo@0.2: 1 problem(s); 2 tasks checked" in r.stdout, r.stdout
    # a spec's tasks may come without references, as the server's Validate takes them: nothing to replay, no problem
    (tmp_path / "bare").mkdir()
    r = await asyncio.to_thread(_envfleet, "envs", "validate", str(_echo_spec(tmp_path / "bare", references=False)))
    assert r.returncode == 0 and "cli-echo@0.2: ok; 2 tasks checked" in r.stdout, (r.stdout, r.stderr)


async def test_status_reads_metrics_and_jobs(tmp_path: Path, base_image: str) -> None:
    async with serve(tmp_path / "data", metrics_port=0) as orch:
        metrics = f"http://127.0.0.1:{orch.metrics_port}/metrics"
        r = await asyncio.to_thread(_envfleet, "status", "--server", orch.address, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    assert "envfleet status" in r.stdout and "queue depth" in r.stdout and f"jobs on {orch.address}" in r.stdout


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "command",
    [
        ["envs", "list"],
        ["envs", "describe", "python-tool"],
        ["envs", "validate", "SPEC"],
        ["envs", "register", "SPEC"],
        ["jobs"],
        ["cancel", "some-job"],
        ["rollout", "--env", "python-tool", "--policy", "http://127.0.0.1:9/v1"],
        ["status"],
    ],
    ids=" ".join,
)
def test_a_bad_address_is_one_clear_line(command: list[str], tmp_path: Path) -> None:
    addr = f"127.0.0.1:{_closed_port()}"
    command = [str(_echo_spec(tmp_path)) if c == "SPEC" else c for c in command]
    if command[0] == "rollout":  # its --out defaults to the working directory's rollouts.jsonl
        command += ["--out", str(tmp_path / "rollouts.jsonl")]
    r = _envfleet(*command, "--server", addr, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("envfleet: cannot "), r.stderr
    assert addr in lines[0] or addr.split(":")[0] in lines[0], r.stderr


def test_a_token_in_clear_is_refused_before_any_call(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("secret\n")
    r = _envfleet("jobs", "--server", "192.0.2.1:50051", "--token-file", str(tmp_path / "token"))
    assert r.returncode == 2 and "refusing to send a bearer token in clear" in r.stderr and "--insecure" in r.stderr
    r = _envfleet("jobs", "--server", "192.0.2.1:50051", "--token-file", str(tmp_path / "nope"))
    assert r.returncode == 2 and f"cannot read --token-file {tmp_path / 'nope'}" in r.stderr


@pytest.mark.parametrize("command", [("image", "build-base"), ("sweep",), ("serve", "--port", "0")])
def test_no_docker_engine_is_one_line_not_a_traceback(command: tuple[str, ...]) -> None:
    # on a fresh machine, before dockerd runs: the docker SDK's exception ran out of main() as a traceback
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr and "cannot reach the Docker engine" in r.stderr, r.stderr


async def test_a_stopped_rollout_command_cancels_its_job_and_cancel_cancels_one(tmp_path: Path) -> None:
    # `envfleet rollout --server` submitted its job before it opened --out (a path it could not write failed it with
    # the job running on), and a Ctrl-C left the job running on the server, nobody reading it; no command cancelled one
    async with silent_policy() as url, serve(tmp_path / "data", backend=FAKE) as orch:
        args = ["--server", orch.address, "--env", "python-tool", "--tasks", "1", "--policy", url]
        r = await asyncio.to_thread(_envfleet, "rollout", *args, "--out", str(tmp_path / "no" / "x.jsonl"))
        assert r.returncode == 1 and not orch.jobs._jobs, r.stderr
        assert (
            r.stderr.strip()
            == f"envfleet: error: cannot write --out {tmp_path / 'no' / 'x.jsonl'}: No such file or directory"
        )
        # a submit refused leaves --out as it was
        kept = tmp_path / "kept.jsonl"
        kept.write_text("earlier rollouts\n")
        bad = ["--server", orch.address, "--env", "no-such-env", "--policy", url, "--out", str(kept)]
        r = await asyncio.to_thread(_envfleet, "rollout", *bad)
        assert r.returncode == 1 and kept.read_text() == "earlier rollouts\n", r.stderr
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "rollout", *args, "--out", str(tmp_path / "x.jsonl")],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            for _ in range(200):
                if orch.jobs._jobs and (await orch.jobs.info(next(iter(orch.jobs._jobs)))).counts.in_flight:
                    break
                await asyncio.sleep(0.05)
            (job_id,) = orch.jobs._jobs
            proc.send_signal(signal.SIGINT)
            out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 130 and f"job {job_id} cancelled" in out, out
        assert (await orch.jobs.info(job_id)).state.value == "CANCELLED"
        job_id, _ = await orch.jobs.submit(job(url, ["py-000"]))
        r = await asyncio.to_thread(_envfleet, "cancel", job_id, "--server", orch.address)
        assert r.returncode == 0 and r.stdout.strip() == f"job {job_id} CANCELLED: 0 of 1 rollouts done", r.stderr
        assert (await orch.jobs.info(job_id)).state.value == "CANCELLED"
        # an --out that is no plain file is written as it is (a link to a file: through the link)
        target, link = tmp_path / "target.jsonl", tmp_path / "link.jsonl"
        target.write_text("")
        link.symlink_to(target)
        ok = ["--server", orch.address, "--env", "python-tool", "--tasks", "1", "--policy", REPLAY, "--out", str(link)]
        r = await asyncio.to_thread(_envfleet, "rollout", *ok)
        assert r.returncode == 0 and link.is_symlink() and len(target.read_text().splitlines()) == 1, r.stderr
