"""The docker-exec fallback transport (images without envd) keeps envd's exec guarantees, enforced from the host: a
wall-clock timeout that kills what the command started, escaped processes killed when the command ends, a process
holding stdout cannot hold the call, capped output with a truncation flag, exit status and timed_out measured."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import docker
import pytest

from orchestrator.backends.docker import DockerBackend
from orchestrator.core.errors import SandboxError, SandboxFileError, SandboxFileNotFoundError
from orchestrator.core.sandbox import SandboxSpec

COUNT_SLEEPS = (
    "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 1037 $' || true"
)


async def test_no_process_outlives_a_docker_exec(backend: DockerBackend, base_image: str) -> None:
    async with await backend.create(SandboxSpec(image=base_image, transport="docker-exec")) as box:
        # the count sees them, once both have started (on a loaded host the second may not have yet: a clean-clone
        # CI run counted 1)
        seen = f'for i in $(seq 100); do n=$({COUNT_SLEEPS}); [ "$n" = 2 ] && break; sleep 0.1; done; echo "$n"'
        r = await box.exec("sleep 1037 & sleep 1037 & " + seen)
        assert r.stdout.strip() == b"2", r
        # escaped from its group and environment, holding stdout: before, the call waited the full timeout (and the
        # sleeps stayed); now it ends when the shell does and the sleeps are gone
        t0 = time.monotonic()
        r = await box.exec("(env -i setsid sh -c 'sleep 1037' &); echo done", timeout=60)
        assert r.ok and r.stdout == b"done\n" and not r.timed_out, r
        assert time.monotonic() - t0 < 30
        assert (await box.exec(COUNT_SLEEPS)).stdout.strip() == b"0"
        # a timeout kills the command and what it started, and says so
        r = await box.exec("(setsid sh -c 'sleep 1037' &); sleep 1037", timeout=1)
        assert r.timed_out and r.exit_code == 137, r
        assert (await box.exec(COUNT_SLEEPS)).stdout.strip() == b"0"
        # output past the cap is dropped and flagged, and a flood cannot hold the call past its timeout
        r = await box.exec(["yes"], max_output=1000, timeout=1)
        assert r.truncated and r.timed_out and len(r.stdout) == 1000
        r = await box.exec("exit 3")
        assert (r.exit_code, r.timed_out, r.truncated) == (3, False, False)

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(4):
                yield b"q" * (1 << 20)

        assert (await box.exec("wc -c", stdin=chunks())).stdout.strip() == str(4 << 20).encode()


async def test_a_path_is_never_the_fallbacks_shell_text_or_finds_expression(
    backend: DockerBackend, base_image: str
) -> None:
    # read_file's path stood in its script's text: a link the policy named `$(...)` ran that on a read_file, a
    # command in an environment that gives it no shell. list_dir("-delete") was find's expression: it emptied the
    # working directory. A relative path starts at the workspace, as envd's do (write_file put it under /)
    async with await backend.create(SandboxSpec(image=base_image, transport="docker-exec")) as box:
        await box.write_file("keep.txt", b"kept")
        name = "x$(touch ran)"
        await box.exec(["ln", "-s", "keep.txt", name])
        with pytest.raises(SandboxFileError, match="is a symbolic link"):
            await box.read_file(name)
        with pytest.raises(SandboxFileNotFoundError):
            await box.list_dir("-delete")
        assert sorted(e.name for e in await box.list_dir(box.spec.workspace)) == sorted(["keep.txt", name])
        assert await box.read_file("keep.txt") == b"kept"


async def test_a_sandbox_removed_under_a_command_is_the_sandboxs_failure_not_the_commands_exit(
    backend: DockerBackend, base_image: str
) -> None:
    # the command came back as exit 137, killed: a scoring command passed the sandbox's end on as a reward of 0 (the
    # envd transport's stream breaks, and the sandbox is found dead)
    async with await backend.create(SandboxSpec(image=base_image, transport="docker-exec")) as box:
        running = asyncio.create_task(box.exec("sleep 60", timeout=60))
        await asyncio.sleep(1.5)  # the command runs
        await asyncio.to_thread(docker.from_env().api.remove_container, box.id, force=True)
        async with asyncio.timeout(30):
            with pytest.raises(SandboxError):
                await running
    async with await backend.create(SandboxSpec(image=base_image, transport="docker-exec")) as box:
        # a command killed in a sandbox that goes on is its own exit, as before
        r = await box.exec("kill -9 $$")
        assert (r.exit_code, r.signal, r.timed_out) == (137, 9, False), r
        # and so is one whose sandbox its own processes stop (docker-init passes their signals on): an unscored
        # retry would be the policy's way out of a bad episode
        r = await box.exec("kill 1; sleep 30", timeout=60)
        assert r.exit_code > 128 and not r.timed_out, r
