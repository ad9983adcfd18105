"""The built-in tools against a real sandbox: what they do to its files, and what they answer the policy."""

from __future__ import annotations

import json

from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.core.sandbox import SandboxSpec
from orchestrator.core.tools import BUILTIN_TOOLS, MAX_EDIT_BYTES, MAX_FILE_READ, call_tool


async def test_str_replace_edits_a_file_and_never_writes_back_one_it_could_not_read_whole(
    backend: DockerBackend, base_image: str
) -> None:
    tool = BUILTIN_TOOLS["str_replace"]
    async with await backend.create(SandboxSpec(image=base_image)) as sb:
        await sb.write_file("small.txt", b"a = 1\n")
        r = await call_tool(tool, sb, json.dumps({"path": "small.txt", "old_str": "1", "new_str": "2"}), 10)
        assert r.output == "edited small.txt" and await sb.read_file("small.txt") == b"a = 2\n"
        # past the edit limit and envd's 16 MiB read: the file was cut at the read, written back cut, and "edited"
        big = b"start = 1\n" + b"x" * (17 << 20)
        await sb.write_file("big.txt", big)
        edit = {"path": "big.txt", "old_str": "start = 1", "new_str": "start = 2"}
        r = await call_tool(tool, sb, json.dumps(edit), 10)
        assert r.output.startswith(f"error: big.txt is over {MAX_EDIT_BYTES >> 20} MiB; str_replace edits smaller")
        size = await sb.exec(["stat", "-c", "%s", "big.txt"])
        assert int(size.stdout) == len(big)


async def test_read_file_says_when_it_shows_only_the_start_of_a_file(backend: DockerBackend, base_image: str) -> None:
    # a file over the read's cap came back cut with no word of it, as if it ended there
    tool = BUILTIN_TOOLS["read_file"]
    async with await backend.create(SandboxSpec(image=base_image)) as sb:
        await sb.write_file("whole.txt", b"y" * MAX_FILE_READ)
        await sb.write_file("long.txt", b"x" * (100 << 10))
        whole = await call_tool(tool, sb, json.dumps({"path": "whole.txt"}), 10)
        long = await call_tool(tool, sb, json.dumps({"path": "long.txt"}), 10)
    assert whole.output == "y" * MAX_FILE_READ
    assert long.output == "x" * MAX_FILE_READ + f"\n[... cut at {MAX_FILE_READ} bytes]"
