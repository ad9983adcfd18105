"""What a sandbox's processes can set up against envd and the next rollout, on real sandboxes: a FIFO where a file
is to be written (envd's file threads), an output sized to Run's message limit (the reply), and the metadata of the
places Reset wipes (a channel to the next rollout on a recycled sandbox), a file of the largest size a tmpfs
allows where the host reads one."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.docker import DockerBackend
from orchestrator.backends.envd_transport import EnvdTransport
from orchestrator.core.errors import SandboxFileError
from orchestrator.core.sandbox import ExecOutput, Limits, SandboxSpec
from orchestrator.core.tools import call_tool, get_tools
from protos import envd_pb2 as pb
from tests.conftest import owned_backend


def _tar(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def test_a_fifo_where_a_file_is_written_is_refused_at_once_and_holds_no_thread(
    backend: DockerBackend, base_image: str
) -> None:
    # an open for writing blocks on a FIFO until a reader comes: each such call held one of envd's few file threads
    # for good, Reset included, and a handful left the sandbox answering no file call (the grader's too), so a
    # policy heading for a reward of 0 could turn it into an infrastructure retry
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        assert (await s.exec("mkfifo /workspace/answer.txt /workspace/up")).exit_code == 0
        t0 = time.monotonic()
        for _ in range(40):  # more than envd's thread pool holds
            with pytest.raises(SandboxFileError, match="not a regular file"):
                await s.write_file("/workspace/answer.txt", b"x")
        with pytest.raises(SandboxFileError, match="not a regular file"):
            await s.upload(_tar("up", b"x"), "/workspace")
        assert time.monotonic() - t0 < 30
        await s.write_file("/workspace/ok.txt", b"fine")
        assert await s.read_file("/workspace/ok.txt") == b"fine"
        assert (await s.reset()).ok


async def test_output_at_runs_message_limit_comes_back_truncated_not_as_a_failure(
    backend: DockerBackend, base_image: str
) -> None:
    # Run answers in one message of at most 64 MiB; an output of 64 MiB (a workspace diff the policy sized) made
    # the reply too big to send, RESOURCE_EXHAUSTED, an infrastructure retry instead of a truncated result
    async with await backend.create(SandboxSpec(image=base_image, limits=Limits(memory_mb=1024))) as s:
        r = await s.exec("head -c 70000000 /dev/zero", max_output=64 << 20, timeout=120)
        assert r.exit_code == 0 and r.truncated
        assert (64 << 20) - (64 << 10) <= len(r.stdout) < 64 << 20


async def test_reset_puts_back_the_workspaces_own_mode_times_and_xattrs(
    backend: DockerBackend, base_image: str
) -> None:
    # emptied, the workspace itself still carried what the last rollout set on it: its mode, a time set with
    # `touch -d`, a user xattr, each readable by the next rollout on the recycled sandbox
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        mark = (
            "import os; os.chmod('/workspace', 0o2757); os.utime('/workspace', (1900000000, 1900000000))\n"
            "try:\n os.setxattr('/workspace', 'user.answer', b'42'); print('xattr')\n"
            "except OSError: pass\n"  # tmpfs has user xattrs from Linux 6.6
        )
        r = await s.exec(["python3", "-c", mark])
        assert r.exit_code == 0, r.stderr
        tagged = r.stdout == b"xattr\n"
        assert (await s.reset()).ok
        read = (
            "import os; st = os.stat('/workspace');"
            " print(oct(st.st_mode & 0o7777), int(st.st_atime), int(st.st_mtime), os.listxattr('/workspace'))"
        )
        out = (await s.exec(["python3", "-c", read])).stdout
        mode, atime, mtime, xattrs = out.split(maxsplit=3)
        assert mode == b"0o755"
        assert max(int(atime), int(mtime)) < time.time() + 60  # the reset's time, not the one set
        assert xattrs.strip() == b"[]", (tagged, xattrs)


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_a_file_of_the_largest_size_is_read_up_to_the_cap_and_envd_lives(impl: str, base_image: str) -> None:
    # the Go envd sized its buffer as the file's size plus one: a sparse file of 2^63-1 bytes (a `truncate -s` in
    # the workspace's tmpfs) wrapped it negative and make() panicked. envd is PID 1: the sandbox died on the host's
    # read (a grader's), an infrastructure failure the policy chose, masked from training
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        r = await s.exec(["truncate", "-s", str((1 << 63) - 1), "huge"])
        assert r.exit_code == 0, r
        assert await s.read_file("huge", max_bytes=16) == b"\0" * 16
        assert (await s.exec(["echo", "alive"])).stdout == b"alive\n"


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_a_reset_tells_the_first_of_many_problems_not_all(impl: str, base_image: str) -> None:
    # each folder left in /tmp that the reset could not remove was a line of its answer: 240,000 of them made every
    # reset of the sandbox answer 64 MiB, which the worker read and logged
    stuck = "cd /tmp && for i in $(seq 50); do mkdir d$i && touch d$i/f && chmod 555 d$i; done"
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        assert (await s.exec(["sh", "-c", stuck])).exit_code == 0
        got = await s.reset()
        assert not got.ok
        # 50 folders, and the check after that /tmp still holds something: 51 problems
        assert got.detail.endswith("; and 41 more") and got.detail.count("; ") == 10, got.detail


TRICKLE = "import os, time\nfor _ in range(20000):\n    os.write(1, b'x')\n    time.sleep(0.00005)\n"


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_output_written_a_byte_at_a_time_comes_in_few_messages(impl: str, base_image: str) -> None:
    # each write was a message of envd's and an event the host relayed to its caller: a command that wrote its 1 MiB
    # of output a byte at a time made a million of them, on the event loop every tenant shares
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        chunks = [
            e.data
            for e in [e async for e in s.exec_stream(["python3", "-c", TRICKLE], timeout=120)]
            if isinstance(e, ExecOutput)
        ]
        assert b"".join(chunks) == b"x" * 20000
        assert len(chunks) < 2000, f"{len(chunks)} messages for 20,000 writes over about 2 s"


# 60 lines on stdout a fifth of a millisecond apart (past the burst), then lines on stdout and stderr in turn, a
# millisecond apart
ALTERNATING = (
    "import os, time\n"
    "for i in range(60):\n    os.write(1, b'%d\\n' % i)\n    time.sleep(0.0002)\n"
    "for i in range(60, 260):\n    os.write(1 + i % 2, b'%d\\n' % i)\n    time.sleep(0.001)\n"
)


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_paced_output_keeps_the_order_of_stdout_and_stderr(impl: str, base_image: str) -> None:
    # past its burst, output is paced; a first version held each pipe's reads apart, so a line of stderr went out
    # before an earlier line of stdout, in most of a run's turns. Two pipes carry no order between them: when envd's
    # loop stalls past a line's millisecond (a loaded host), both are readable at once and two lines can swap. That
    # swap is rare and random, the bug's is every run: the order must hold in one of three runs, and every run must
    # carry every line
    runs = []
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        for _ in range(3):
            events = [e async for e in s.exec_stream(["python3", "-c", ALTERNATING], timeout=60)]
            lines = [int(n) for e in events if isinstance(e, ExecOutput) for n in e.data.split()]
            assert sorted(lines) == list(range(260))
            runs.append(lines)
            if lines == list(range(260)):
                return
    out_of_order = [[n for i, n in enumerate(lines) if n != i][:10] for lines in runs]
    raise AssertionError(f"stdout and stderr out of order in every run: {out_of_order}")


ENDLESS = "import os, time\nwhile True:\n    os.write(1, b'x')\n    time.sleep(0.0001)\n"


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_a_command_that_never_stops_writing_still_times_out(impl: str, base_image: str) -> None:
    # the contract on real sandboxes, with either envd; the Python envd's loop once checked its deadline only when
    # no output was pending, and with a consumer slower than the writes ran on past it (tests/envd/test_child_output.py)
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        r = await s.exec(["python3", "-c", ENDLESS], timeout=1)
        assert r.timed_out and r.duration_s < 5, r


async def test_a_path_past_any_length_is_a_file_error_with_a_bounded_message(
    envd_client: EnvdTransport, backend: DockerBackend, base_image: str
) -> None:
    # envd's status message carried the path whole (ENAMETOOLONG's), and past grpc's metadata limit the call broke as
    # INTERNAL "Stream removed", which the host takes for a lost sandbox: one read_file of a 20,000-character path
    # made the rollout INFRA_ERROR, masked. Each envd on the host, then a real sandbox through the tool
    path = "/" + "a" * 20_000 + "\u00e9" * 10
    for call in (envd_client.read_file(path), envd_client.write_file(path, b"x")):
        with pytest.raises(SandboxFileError) as e:
            await call
        message = str(e.value)
        assert len(message.encode()) < 2048 and "more bytes]" in message, message[:300]
    tools = {t.name: t for t in get_tools(("read_file", "write_file"))}
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        for name, args in (("read_file", {"path": path}), ("write_file", {"path": path, "content": "x"})):
            result = await call_tool(tools[name], s, json.dumps(args), 10)
            assert result.output.startswith("error: /aaa") and "more bytes]" in result.output, result.output[:300]
        assert (await s.exec("true")).exit_code == 0  # and the sandbox serves on


async def test_a_path_that_is_no_utf8_is_a_file_error_not_a_hung_call(
    envd_client: EnvdTransport, host_envd: tuple[str, str, Path]
) -> None:
    # a status message is strict UTF-8 to grpc: the Python envd's, holding a link target's byte 0xff as a surrogate,
    # broke the abort itself and the call hung until the host's deadline (INFRA_ERROR). Both envds say \xff
    _, _, ws = host_envd
    os.symlink(b"\xff", bytes(ws / "l"))
    async with asyncio.timeout(20):
        with pytest.raises(SandboxFileError) as e:
            await envd_client.read_file(str(ws / "l" / "x"))
    assert "\\xff" in str(e.value), str(e.value)


# a process whose main thread has exited while another of its threads runs: /proc shows it as a zombie ("Z"), and
# envd took it for one; it beats (writes a counter to /tmp/beat) as long as it lives
HALF_DEAD = """import ctypes, threading, time
def beat():
    n = 0
    while True:
        n += 1
        with open("/tmp/beat", "w") as f:
            f.write(str(n))
        time.sleep(0.05)
threading.Thread(target=beat).start()
ctypes.CDLL(None).pthread_exit(None)
"""


async def _beats(s: Any) -> bool:
    """Whether the half-dead process still writes its counter."""
    first = await s.read_file("/tmp/beat")
    await asyncio.sleep(0.5)
    return bool(await s.read_file("/tmp/beat") != first)


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_a_process_whose_main_thread_exited_dies_with_its_command_and_at_a_reset(
    impl: str, base_image: str
) -> None:
    # it escaped its command's process group (setsid) and read as a zombie, so neither the command's end nor a
    # Reset killed it: it ran on into the next rollout of a recycled sandbox, and beside a grader in the same one
    start = "(env -i setsid python3 /tmp/half.py &); sleep 1; echo started"
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        await s.write_file("/tmp/half.py", HALF_DEAD.encode())
        r = await s.exec(["sh", "-c", start], timeout=30)
        assert r.stdout == b"started\n", r
        assert not await _beats(s), "it outlived the command that started it"

        # one a command asked to keep (keep_background, as an environment's service would be) is a Reset's to end
        transport = getattr(s, "transport", None)  # a docker sandbox's envd connection
        assert isinstance(transport, EnvdTransport)
        kept = await transport._proc.Run(
            pb.ProcessRequest(shell=start, keep_background=True, timeout_s=30), metadata=transport._md, timeout=60
        )
        assert kept.stdout == b"started\n" and await _beats(s)
        outcome = await s.reset()
        assert outcome.ok, outcome.detail
        await s.write_file("/tmp/beat", b"0")
        await asyncio.sleep(0.5)
        assert await s.read_file("/tmp/beat") == b"0", "it outlived the reset"


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_a_name_that_is_no_utf8_is_listed_not_a_failed_call(impl: str, base_image: str) -> None:
    # a proto string cannot carry a byte that is no UTF-8: one such name (or link target) a command made failed the
    # whole ListDir as INTERNAL, which the host takes for a dead envd. Such bytes are listed as U+FFFD
    make = (
        "mkdir -p /workspace/d && cd /workspace/d && touch ok $(printf 'bad\\377name') && ln -s $(printf '\\376') link"
    )
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        assert (await s.exec(["sh", "-c", make])).exit_code == 0
        entries = {e.name: e for e in await s.list_dir("/workspace/d")}
        assert set(entries) == {"ok", "bad\ufffdname", "link"}, entries
        assert entries["link"].link_target == "\ufffd"
        assert (await s.exec(["echo", "alive"])).stdout == b"alive\n"
