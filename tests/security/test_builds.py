"""Builds are sandboxes too: a tenant's Dockerfile is parsed as the builder reads it and every way out of the build
is refused (other images, ADD <url>, ONBUILD, frontends, the host's files); builds run under memory, CPU and time
limits, and the disk their layers may take; and build slots are counted per tenant."""

from __future__ import annotations

import asyncio
import contextlib
import io
import secrets
import subprocess
import tarfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import docker
import grpc
import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import ImageBuildError, InvalidRequestError
from orchestrator.images.build import BuildLimits, build_image
from orchestrator.service.declarative.dockerfile import DockerfileError, check
from orchestrator.service.tenancy import TenantGate
from protos import orchestrator_pb2 as pb
from tests.orchestrator.servers import expect_error, serve

BASE = "FROM envfleet/base:latest\n"


@pytest.mark.parametrize(
    ("dockerfile", "message"),
    [
        # a continuation line swallows the last FROM: the stage that is really built is alpine's
        ("FROM alpine:3 AS evil\nRUN echo x \\\nFROM envfleet/base:latest\n", "the final stage is FROM 'alpine:3'"),
        ("FROM debian:12 AS tools\nRUN true\n" + BASE + "COPY --from=tools /bin/ls /x\n", "FROM 'debian:12'"),
        (BASE + "COPY --from=busybox:latest /bin/sh /x\n", "COPY --from 'busybox:latest'"),
        (BASE + "RUN --mount=type=bind,from=alpine:3,target=/m true\n", "RUN --mount from 'alpine:3'"),
        (BASE + "RUN --network=host true\n", "RUN --network is not allowed"),
        (BASE + "ADD http://127.0.0.1:1/x /x\n", "the daemon would fetch it on the host network"),
        (BASE + 'ADD ["https://example.com/x", "/x"]\n', "the daemon would fetch it"),
        (BASE + "ADD git@github.com:o/r.git /r\n", "the daemon would fetch it"),
        (BASE + "ONBUILD RUN curl evil\n", "ONBUILD is not allowed"),
        ("# syntax=docker/dockerfile:1\n" + BASE, "would pull a builder frontend image"),
        ("ARG B=alpine\nFROM $B\n", "uses a variable"),
        ("FROM envfleet/env-someone-else:0123456789ab\n", "another environment's image"),
        # a blank line inside a continuation is skipped, as the builder does: the next FROM joins the first
        ("# escape=`\nFROM alpine AS x `\n  \nFROM envfleet/base\n" + "RUN true\n", "line 2: FROM takes an image"),
        (BASE + "COPY ../../../etc/passwd /x\n", "leaves the build context"),
        ("RUN true\n", "no FROM line"),
        # the builder splits the keyword from its arguments on any of [ \t\v\f\r], not only a space
        (BASE + "ADD\thttp://127.0.0.1:1/x /x\n", "the daemon would fetch it on the host network"),
        (BASE + "ADD\vhttp://127.0.0.1:1/x /x\n", "the daemon would fetch it on the host network"),
        (BASE + "ADD\fhttp://127.0.0.1:1/x /x\n", "the daemon would fetch it on the host network"),
        (BASE + "ADD \t http://127.0.0.1:1/x\t/x\n", "the daemon would fetch it on the host network"),
        (BASE + "COPY\t--from=busybox:latest /bin/sh /x\n", "COPY --from 'busybox:latest'"),
        (BASE + "ONBUILD\tRUN true\n", "ONBUILD is not allowed"),
        (BASE + "FROM\talpine:3\n", "the final stage is FROM 'alpine:3'"),
        (BASE + "add http://127.0.0.1:1/x /x\n", "the daemon would fetch it"),
        (BASE + "\xa0 ADD http://127.0.0.1:1/x /x\n", "the daemon would fetch it"),
        # a keyword glued to its argument by other characters is no instruction the checker can classify
        (BASE + "ADD\xa0http://127.0.0.1:1/x /x\n", "is not a Dockerfile instruction"),
        (BASE + "ADD\x1fhttp://127.0.0.1:1/x /x\n", "is not a Dockerfile instruction"),
        # a continuation joins lines with nothing between them: the keyword can be split over two lines
        (BASE + "AD\\\nD http://127.0.0.1:1/x /x\n", "the daemon would fetch it"),
        # a line continues only when the escape is followed by spaces and tabs alone: NBSP, \v, \f, \x1f end it
        (BASE + "RUN true \\\xa0\nADD http://127.0.0.1:1/x /x\n", "not a line continuation"),
        (BASE + "RUN true \\\v\nADD http://127.0.0.1:1/x /x\n", "not a line continuation"),
        (BASE + "RUN true \\\f\nADD http://127.0.0.1:1/x /x\n", "not a line continuation"),
        (BASE + "RUN true \\\x1f\nADD http://127.0.0.1:1/x /x\n", "not a line continuation"),
        # older scanners drop one \r before the \n, newer ones every \r at the end
        (BASE + "RUN true \\\r\r\nADD http://127.0.0.1:1/x /x\n", "carriage return"),
        # engines disagree on a doubled escape at the end of a line (older ones continue, newer ones do not)
        (BASE + "RUN echo \\\\\nADD http://127.0.0.1:1/x /x\n", "ends with more than one escape"),
        # a heredoc's body is not instructions to newer builders (and its terminator may end in the escape)
        (BASE + "RUN <<'RUN \\'\nRUN \\\nADD http://127.0.0.1:1/x /x\n", "heredoc"),
        # the builder expands quotes, escapes and variables in ADD sources and flags, and in FROM's image
        (BASE + 'ADD "http://127.0.0.1:1/x" /x\n', "quotes, escapes or variables"),
        (BASE + 'ADD ["\\"http://127.0.0.1:1/x\\"", "/x"]\n', "quotes, escapes or variables"),
        ("ARG U=http://127.0.0.1:1/x\n" + BASE + "ADD $U /x\n", "quotes, escapes or variables"),
        (BASE + "COPY --from=envfleet/env\\-victim:0123456789ab /x /x\n", "write flags as --name=value"),
        (BASE + "COPY --from busybox:latest /bin/sh /x\n", "write flags as --name=value"),
        ('FROM envfleet/en"v-victim":0123456789ab\n', "not a plain image or stage name"),
        # the escape directive is honoured on the first line only; elsewhere engines disagree on it
        ("# check=skip=all\n# escape=`\n" + BASE + "RUN true `\nADD http://127.0.0.1:1/x /x\n", "only as the first"),
        (" # escape=`\n" + BASE, "the first line"),
        ("# escape=\\\n# syntax=docker/dockerfile:1\n" + BASE, "would pull a builder frontend image"),
        # text appended to the file (Harbor's image tail) would join the last instruction
        (BASE + "ADD http://127.0.0.1:1/x \\\n", r"its last instruction \(line 2\) continues past the end"),
        (BASE + "RUN true \\\n# a comment\n\n", "continues past the end of the file"),
        # an engine volume is writable outside the read-only root and the tmpfs caps
        (BASE + "VOLUME /data\n", "VOLUME is not allowed"),
        (BASE + 'volume\t["/data"]\n', "VOLUME is not allowed"),
        (BASE + 'ENTRYPOINT ["/start.sh"]\n', "ENTRYPOINT never runs in a sandbox"),
        (BASE + "HEALTHCHECK CMD true\n", "HEALTHCHECK never runs in a sandbox"),
        (BASE + "RUN cat <<EOF>/x\n", "heredoc"),
        (BASE + "RUN cat 2<<-'END'\n", "heredoc"),
        # an image of another platform is pulled (whatever the host has under that tag)
        ("FROM --platform=linux/s390x envfleet/base:latest\n", "FROM --platform is not allowed"),
    ],
)
def test_dockerfile_ways_out_are_refused(dockerfile: str, message: str) -> None:
    with pytest.raises(DockerfileError, match=message.replace("[", r"\[").replace("$", r"\$")):
        check(dockerfile)


@pytest.mark.parametrize(
    "dockerfile",
    [
        BASE + "RUN echo a \\\n  # a comment inside a continuation\n  && echo b\n",
        "FROM envfleet/base:latest AS build\nRUN echo hi > /tmp/x\n" + BASE + "COPY --from=build /tmp/x /x\n",
        BASE + "COPY --from=0 /etc/hostname /x\n",
        "# escape=`\n" + BASE + "RUN echo a `\n  && echo b\n",
        "\ufeff" + BASE + "RUN\techo a \\ \t\r\n\n  # comment\n  && echo b\r\n",
        "from envfleet/base:latest as build\nrun echo hi\n  FROM\tbuild\ncopy --from=build --chown=0:0 /x /y\n",
        BASE + 'RUN --mount=type=cache,target=/root/.cache echo "héllo \\"quoted\\"" \\\n && echo b\n',
        # shifts, here-strings and C++ streams are no heredocs
        BASE + "RUN python3 -c 'print(1 << 4)' && read v <<< \"$x\" && printf 'std::cout << x;' > a.cpp\n",
        # an earlier stage's entrypoint is never the sandbox's
        'FROM envfleet/base:latest AS build\nENTRYPOINT ["/bin/true"]\n' + BASE,
    ],
)
def test_legitimate_dockerfiles_pass(dockerfile: str) -> None:
    check(dockerfile)


@pytest.mark.parametrize(
    "setup",
    [
        "--mount=type=bind,from=envfleet/env-victim:0123456789ab,target=/m cp -a /m /x",
        "--network=host curl http://127.0.0.1:1/",
    ],
)
def test_a_setup_command_that_is_a_run_flag_is_refused(setup: str) -> None:
    # a spec's setup commands become RUN lines unchecked: one that starts with a RUN flag read another environment's
    # image on a builder that takes --mount (the classic builder refuses it today; BuildKit would not)
    from pydantic import ValidationError

    from orchestrator.service.declarative.spec import ImageDef

    # several lines go in as JSON, where the builder reads no flag nor heredoc: a heredoc there is the shell's
    assert ImageDef(setup=["echo ok", "set -e\n  true", "python3 - <<'PY'\nprint(1)\nPY"]).setup
    with pytest.raises(ValidationError, match=r"setup\[1\] '--.*RUN --(mount|network)"):
        ImageDef(setup=["echo ok", setup])


def test_the_check_names_every_image_a_dockerfile_reads() -> None:
    # what the build must find on the host: every FROM and --from that is no stage of the file's own, however the
    # line is written (a FROM continued onto the next line was missed by a reading of FROM lines)
    text = (
        "FROM \\\n  envfleet/tools:1 AS tools\nRUN true\n"
        + BASE
        + "COPY --from=tools /a /a\nCOPY --from=envfleet/data:2 /b /b\n"
        + "RUN --mount=type=bind,from=envfleet/more:3,target=/m true\n"
    )
    assert check(text) == ["envfleet/tools:1", "envfleet/base:latest", "envfleet/data:2", "envfleet/more:3"]


class Canary:
    """An HTTP server on 127.0.0.1 that records every request it gets."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            line = await reader.readline()
            self.requests.append(line.decode(errors="replace").strip())
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 6\r\n\r\ncanary")
            await writer.drain()
            writer.close()

        self._server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@pytest.fixture
async def canary() -> AsyncIterator[Canary]:
    c = Canary()
    await c.start()
    yield c
    await c.close()


def _spec(dockerfile: str, name: str = "sec-build") -> pb.EnvironmentSpec:
    return pb.EnvironmentSpec(
        name=name,
        version="1",
        image=pb.ImageSource(dockerfile=dockerfile),
        tools=["submit"],
        tasks=[pb.TaskSpec(id="t", prompt="p", reference=[pb.ToolCall(name="submit", arguments="{}")])],
        scoring=pb.ScoringSpec(command="echo '{\"reward\": 1}'"),
    )


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("FROM {base}\nADD {url} /x\n", "the daemon would fetch it on the host network"),
        # the builder splits the keyword on a tab too
        ("FROM {base}\nADD\t{url} /x\n", "the daemon would fetch it on the host network"),
        # NBSP after the escape: Python's rstrip() saw a continuation, the builder sees RUN, then ADD
        ("FROM {base}\nRUN true \\\xa0\nADD {url} /x\n", "not a line continuation"),
        # the builder unquotes ADD's sources
        ('FROM {base}\nADD "{url}" /x\n', "has quotes, escapes or variables"),
        # this engine honours no escape directive after an unknown one: RUN ends at its backtick, then ADD
        ("# check=skip=all\n# escape=`\nFROM {base}\nRUN true #`\nADD {url} /x\n", "an escape directive"),
    ],
    ids=["space", "tab", "nbsp-continuation", "quoted", "late-escape-directive"],
)
async def test_add_url_is_refused_and_the_canary_hears_nothing(
    tmp_path: Path, canary: Canary, docker_client: docker.DockerClient, base_image: str, template: str, message: str
) -> None:
    marker = uuid.uuid4().hex
    dockerfile = template.format(base=base_image, url=f"{canary.url}/{marker}")
    # the threat is real: unchecked, the engine fetches the URL on the host network despite --network none
    tag = await asyncio.to_thread(
        build_image, docker_client, name="sec-canary", dockerfile=dockerfile, context_files={}, cache_dir=tmp_path
    )
    docker_client.images.remove(tag, force=True)
    assert any(marker in r for r in canary.requests), canary.requests
    canary.requests.clear()
    async with serve(tmp_path / "data") as orch, EnvfleetClient(orch.address) as client:
        for call in (client.env_stub.Validate, client.env_stub.Register):
            await expect_error(
                call(_spec(dockerfile.replace(base_image, "envfleet/base:latest"))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "image.dockerfile",
                message,
            )
    await asyncio.sleep(0.5)
    assert canary.requests == []


async def test_a_build_cannot_read_the_hosts_files(tmp_path: Path, base_image: str) -> None:
    # the context holds the Dockerfile alone: an absolute source is the context's, not the host's
    async with serve(tmp_path / "data") as orch, EnvfleetClient(orch.address) as client:
        dockerfile = f"FROM envfleet/base:latest\nCOPY /etc/hostname /stolen-{uuid.uuid4().hex}\n"
        await expect_error(
            client.env_stub.Validate(_spec(dockerfile)), grpc.StatusCode.FAILED_PRECONDITION, "does not build"
        )


def _containers_with(marker: str) -> list[str]:
    out = subprocess.run(
        ["docker", "ps", "-a", "--no-trunc", "--format", "{{.ID}} {{.Command}}"], capture_output=True, text=True
    ).stdout
    return [line for line in out.splitlines() if marker in line]


def _refused(
    client: docker.DockerClient,
    cache: Path,
    name: str,
    dockerfile: str,
    limits: BuildLimits,
    match: str,
    within_s: float,
) -> ImageBuildError:
    """Build `dockerfile` under `limits`: it must fail with `match` within `within_s` (stopped, not left to run)."""
    started = time.monotonic()
    with pytest.raises(ImageBuildError, match=match) as raised:
        build_image(client, name=name, dockerfile=dockerfile, context_files={}, cache_dir=cache, limits=limits)
    assert time.monotonic() - started < within_s
    return raised.value


def _assert_gone(marker: str, images: bool = False) -> None:
    """Within 20 s, no container of a build marked `marker` is left (nor, with `images`, an image labelled so)."""

    def left() -> list[str]:
        return _containers_with(marker) + (_images_labelled(marker) if images else [])

    deadline = time.monotonic() + 20
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left() == []


def test_build_memory_limit(docker_client: docker.DockerClient, tmp_path: Path, base_image: str) -> None:
    marker = uuid.uuid4().hex
    dockerfile = f"FROM {base_image}\nRUN python3 -c 'b = bytearray(400 << 20); print(len(b), \"{marker}\")'\n"
    with pytest.raises(ImageBuildError, match="returned a non-zero code: 137"):
        build_image(
            docker_client,
            name="sec-memory",
            dockerfile=dockerfile,
            context_files={},
            cache_dir=tmp_path,
            limits=BuildLimits(memory_mb=128),
        )


@pytest.mark.parametrize("chatty", [False, True], ids=["silent", "chatty"])
def test_build_time_limit(docker_client: docker.DockerClient, tmp_path: Path, base_image: str, chatty: bool) -> None:
    marker = uuid.uuid4().hex
    step = f"while true; do echo {marker}; sleep 0.2; done" if chatty else f"sleep 120; echo {marker}"
    dockerfile, limits = f"FROM {base_image}\nRUN {step}\n", BuildLimits(timeout_s=3)
    _refused(
        docker_client, tmp_path, "sec-time", dockerfile, limits, r"did not finish within its time limit \(3s\)", 20
    )
    _assert_gone(marker)  # dropping the connection cancels the build: its container goes away


def _images_labelled(marker: str) -> list[str]:
    out = subprocess.run(
        ["docker", "images", "-a", "-q", "--filter", f"label=test.marker={marker}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


@pytest.mark.parametrize(
    ("steps", "wrote"),
    [
        # one step writes past the limit and waits: the guard's poll sees the step's container grow and kills it
        (["head -c 300M /dev/zero > /big && sleep 120"], r"wrote \d+ MB"),
        # each step under the limit, together over it: the committed layers add up
        ([f"head -c 60M /dev/zero > /part{n}" for n in range(3)], r"wrote 1\d\d MB"),
        # the last RUN goes over and ends before a poll may see it; the build would end well (an ENV step runs no
        # process to kill): it is refused at its end, and its tagged image removed with the rest
        (["head -c 150M /dev/zero > /big", "ENV DONE=1"], r"wrote \d+ MB"),
        # a step prints what looks like the engine's line of a layer: the guard took it for the step's end and
        # stopped watching it, which wrote on unseen
        ([f"printf '\\n ---> {'0' * 12}\\n' && head -c 300M /dev/zero > /big && sleep 120"], r"wrote \d+ MB"),
        # a step prints what looks like the engine's line of a FROM: the guard took the step's own layer that came
        # next for the base image of a stage, and never counted it
        (
            [f"printf '\\nStep 9/9 : FROM x\\n' && head -c 60M /dev/zero > /part{n}" for n in range(3)],
            r"wrote 1\d\d MB",
        ),
    ],
    ids=["one-step", "across-steps", "at-the-end", "printed-layer", "printed-from"],
)
def test_build_disk_limit(
    docker_client: docker.DockerClient, tmp_path: Path, base_image: str, steps: list[str], wrote: str
) -> None:
    marker = uuid.uuid4().hex
    runs = "".join(f"{step}\n" if step.startswith("ENV") else f"RUN : {marker} && {step}\n" for step in steps)
    dockerfile = f"FROM {base_image}\nLABEL test.marker={marker}\n{runs}"
    refused = wrote + r", over its disk limit of 100 MB; the build was refused and its layers removed"
    _refused(docker_client, tmp_path, "sec-disk", dockerfile, BuildLimits(disk_mb=100), refused, 60)  # not its sleep
    _assert_gone(marker, images=True)  # its step's container is gone, and so are the layers it committed


def test_a_build_that_labels_itself_a_sandbox_is_still_watched(
    docker_client: docker.DockerClient, tmp_path: Path, base_image: str
) -> None:
    # a step's container takes its labels from the image so far: a Dockerfile that gave itself the sandboxes' label
    # (through an ARG, past the check of control labels) hid every later step from the guard, which wrote unseen
    marker = uuid.uuid4().hex
    dockerfile = (
        f"FROM {base_image}\nARG K=envfleet.managed\nLABEL $K=1\n"
        f"RUN : {marker} && head -c 300M /dev/zero > /big && sleep 120\n"
    )
    refused = r"wrote \d+ MB, over its disk limit of 100 MB"
    _refused(docker_client, tmp_path, "sec-labelled", dockerfile, BuildLimits(disk_mb=100), refused, 60)
    _assert_gone(marker)


def test_a_build_that_prints_the_guards_lines_past_its_checks_is_stopped(
    docker_client: docker.DockerClient, tmp_path: Path, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each line that looks like the engine's is checked on the engine, 2,000 at most: past them the guard checked no
    # more, so a later step was no longer watched. The build is stopped there
    from orchestrator.images import disk_guard

    monkeypatch.setattr(disk_guard, "MAX_CHECKS", 5)
    marker = uuid.uuid4().hex
    fakes = "".join(f"\\n ---> {n:012x}" for n in range(10))
    dockerfile = (
        f"FROM {base_image}\nRUN : {marker} && printf '{fakes}\\n'\n"
        f"RUN : {marker} && head -c 300M /dev/zero > /big && sleep 120\n"
    )
    match = "printed more than 5 lines that look like the builder's own"
    _refused(docker_client, tmp_path, "sec-checks", dockerfile, BuildLimits(disk_mb=100), match, 60)
    _assert_gone(marker)


def test_a_failed_build_never_removes_an_image_it_names(
    docker_client: docker.DockerClient, tmp_path: Path, base_image: str
) -> None:
    # a step printed another image's id as if the engine had committed it: the guard took it for one of the build's
    # layers, and removed it with them when the build failed (an image's id is in every rollout's provenance)
    marker = uuid.uuid4().hex
    victim = build_image(
        docker_client,
        name="sec-victim",
        dockerfile=f"FROM {base_image}\nRUN echo {marker} > /m\n",
        context_files={},
        cache_dir=tmp_path,
    )
    try:
        short = str(docker_client.images.get(victim).id).removeprefix("sha256:")[:12]
        dockerfile = f"FROM {base_image}\nRUN printf '\\n ---> {short}\\n' && exit 3\n"
        _refused(docker_client, tmp_path, "sec-names", dockerfile, BuildLimits(), "returned a non-zero code: 3", 60)
        assert docker_client.images.get(victim).tags == [victim]
    finally:
        docker_client.images.remove(victim, force=True)


def test_the_disk_guard_never_kills_a_container_a_build_names(
    docker_client: docker.DockerClient, base_image: str
) -> None:
    # past its limit, the guard killed whatever container a line " ---> Running in <id>" named: a build could print
    # a sandbox's id (a sandbox's hostname), and the guard killed it
    from orchestrator.images.disk_guard import DiskGuard

    base = str(docker_client.images.get(base_image).id)
    made = []
    try:  # each removed whatever fails (a guard that cannot be made left `older` running)
        older = docker_client.containers.run(base_image, ["sleep", "60"], detach=True, network_mode="none")
        made.append(older)
        time.sleep(1.1)  # the guard's build starts after `older` was made
        guard = DiskGuard(docker_client, 1, bases=[base])
        sandbox = docker_client.containers.run(
            base_image, ["sleep", "60"], detach=True, network_mode="none", labels={"envfleet.managed": "1"}
        )
        made.append(sandbox)
        guard.over = "past its limit"
        for victim in (older, sandbox):
            guard.saw(f" ---> Running in {victim.id[:12]}")
        time.sleep(1)
        for victim in (older, sandbox):
            victim.reload()
            assert victim.status == "running", victim.name
    finally:
        for c in made:
            c.remove(force=True)


# 400 MB of lines, then a long wait: the log on this host's disk stops at the limit, and so does the build; in
# characters of four bytes too (counted as characters, they made a log four times the limit)
OUTPUTS = {
    "ascii": "head -c 400M /dev/zero | tr '\\0' x | fold -w 1000",
    "four-byte": "python3 -c 'import sys; [sys.stdout.write(chr(0x1F600) * 250 + chr(10)) for _ in range(400000)]'",
}


@pytest.mark.parametrize("output", OUTPUTS.values(), ids=OUTPUTS.keys())
def test_build_output_limit(docker_client: docker.DockerClient, tmp_path: Path, base_image: str, output: str) -> None:
    marker = uuid.uuid4().hex
    step = f": {marker} && {output} && sleep 120"
    dockerfile, limits = f"FROM {base_image}\nRUN {step}\n", BuildLimits(output_mb=8)
    error = _refused(docker_client, tmp_path, "sec-output", dockerfile, limits, r"the build printed more than 8 MB", 60)
    assert error.log_path is not None and (8 << 20) < error.log_path.stat().st_size < (9 << 20)
    _assert_gone(marker)  # dropping the connection cancels the build: its container goes away


def test_a_failed_build_keeps_the_images_it_took_from_the_cache(
    docker_client: docker.DockerClient, tmp_path: Path, base_image: str
) -> None:
    marker = uuid.uuid4().hex
    first = f"FROM {base_image}\nRUN echo {marker} > /m\n"
    kept = build_image(docker_client, name="sec-cached", dockerfile=first, context_files={}, cache_dir=tmp_path)
    try:
        # its first step is the image above, from the cache; the build fails after it: only what it wrote goes
        with pytest.raises(ImageBuildError, match="returned a non-zero code: 3"):
            build_image(
                docker_client,
                name="sec-cached-fails",
                dockerfile=first + "RUN head -c 1M /dev/zero > /a\nRUN exit 3\n",
                context_files={},
                cache_dir=tmp_path,
                limits=BuildLimits(),
            )
        assert docker_client.images.get(kept).tags == [kept]
    finally:
        docker_client.images.remove(kept, force=True)


def test_a_build_under_its_disk_limit_is_kept(
    docker_client: docker.DockerClient, tmp_path: Path, base_image: str
) -> None:
    marker = uuid.uuid4().hex
    tag = build_image(
        docker_client,
        name="sec-disk-ok",
        dockerfile=f"FROM {base_image}\nLABEL test.marker={marker}\nRUN head -c 40M /dev/zero > /a\n",
        context_files={},
        cache_dir=tmp_path,
        limits=BuildLimits(disk_mb=100),
    )
    try:
        assert docker_client.images.get(tag).attrs["Size"] >= 40 << 20
    finally:
        docker_client.images.remove(tag, force=True)
    assert _images_labelled(marker) == []


async def test_tenant_gate_keeps_a_slot_for_others() -> None:
    gate = TenantGate(total=2, per_tenant=1)
    order: list[str] = []
    release = asyncio.Event()

    async def build(tenant: str, n: int) -> None:
        async with gate.slot(tenant):
            order.append(f"{tenant}{n}")
            if tenant == "a":
                await release.wait()

    greedy = [asyncio.create_task(build("a", n)) for n in range(5)]
    await asyncio.sleep(0.05)
    assert gate.held("a") == 1
    await asyncio.wait_for(build("b", 0), 1)  # b gets the free slot while a's four others wait
    assert order == ["a0", "b0"]
    release.set()
    await asyncio.gather(*greedy)
    assert gate.held("a") == 0 and len(order) == 6


async def test_one_tenant_cannot_hold_every_build_slot(tmp_path: Path, base_image: str) -> None:
    token_a, token_b = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"tokens:\n  {token_a}: team-a\n  {token_b}: team-b\n")
    async with (
        serve(tmp_path / "data", security={"token_file": tokens}) as orch,
        EnvfleetClient(orch.address, token=token_a) as a,
        EnvfleetClient(orch.address, token=token_b) as b,
    ):
        slow = [
            asyncio.ensure_future(
                a.env_stub.Validate(_spec(f"{BASE}RUN sleep 12 && echo {uuid.uuid4().hex}\n", f"slow-{n}"))
            )
            for n in range(2)
        ]
        await asyncio.sleep(1.5)  # a's validations hold what they can
        quick = _spec(f"{BASE}RUN echo {uuid.uuid4().hex}\n", "quick")
        report = await asyncio.wait_for(b.env_stub.Validate(quick), 60)
        assert report.image and not all(s.done() for s in slow)
        await asyncio.gather(*slow)


def _tenant_build(
    client: docker.DockerClient, name: str, text: str, cache: Path, limits: BuildLimits | None = None
) -> str:
    """Build `text` as a tenant's Dockerfile is built: under limits, reading only the images its check names."""
    return build_image(
        client,
        name=name,
        dockerfile=text,
        context_files={},
        cache_dir=cache,
        limits=limits or BuildLimits(),
        from_images=check(text),
    )


def test_a_tenant_build_never_pulls_and_keys_on_every_image_it_reads(
    docker_client: docker.DockerClient, tmp_path: Path, base_image: str
) -> None:
    # the engine pulls a FROM or --from image it lacks, over the host network (--network none is the build's
    # steps'): docker.io/envfleet/... is whoever owns that name there. A tenant's build names no image the host lacks
    marker = uuid.uuid4().hex[:12]
    for text in (
        f"FROM envfleet/missing-{marker}:1\n",
        f"FROM {base_image}\nCOPY --from=envfleet/gone-{marker}:2 /a /a\n",
    ):
        with pytest.raises(ImageBuildError, match="is not an image on this host; builds are offline and never pull"):
            _tenant_build(docker_client, f"sec-pull-{marker}", text, tmp_path)
    # and an image it reads however it is written is an input of the cache: the same text on another image of the
    # same name builds anew (the FROM continued onto the next line kept the old one's image)
    alias = f"envfleet/sec-alias-{marker}:1"
    text = f"FROM \\\n  {alias}\nLABEL test.marker={marker}\n"
    docker_client.images.get(base_image).tag(alias)
    made: list[str] = []
    try:
        made.append(_tenant_build(docker_client, "sec-alias", text, tmp_path))
        other = build_image(
            docker_client,
            name="sec-alias-other",
            dockerfile=f"FROM {base_image}\nRUN echo {marker} > /m\n",
            context_files={},
            cache_dir=tmp_path,
        )
        made.append(other)
        docker_client.images.get(other).tag(alias)  # the same name, another image
        made.append(_tenant_build(docker_client, "sec-alias", text, tmp_path))
        assert made[0] != made[2]
    finally:
        for tag in [*made, alias]:
            with contextlib.suppress(docker.errors.ImageNotFound):
                docker_client.images.remove(tag, force=True)


def test_a_spec_file_whose_path_reads_as_a_pattern_gets_its_own_bytes(
    docker_client: docker.DockerClient, tmp_path: Path, base_image: str
) -> None:
    # the builder reads *, ? and [ in a COPY source as a pattern: the context file of /opt/[a] was files/opt/[a],
    # which matched files/opt/a, and the image's /opt/[a] held /opt/a's bytes
    from orchestrator.core.image_spec import ImageSpec
    from orchestrator.images.spec import build_from_spec

    spec = ImageSpec(base=base_image, files={"/opt/[a]": "bracket\n", "/opt/a": "plain\n", "/opt/?": "question\n"})
    tag = build_from_spec(docker_client, name="sec-globs", spec=spec, limits=BuildLimits(), from_images=[base_image])
    try:
        out = docker_client.containers.run(
            tag, ["cat", "/opt/[a]", "/opt/a", "/opt/?"], remove=True, network_mode="none", entrypoint=[]
        )
        assert out == b"bracket\nplain\nquestion\n"
    finally:
        docker_client.images.remove(tag, force=True)


def test_a_tenant_build_never_takes_the_disk_sandboxes_need(
    docker_client: docker.DockerClient, tmp_path: Path, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a tenant's images (a Validate's too) and each build's log filled the engine's disk, which stops every sandbox
    # on it. A build starts only while its disk limit leaves a floor free
    import re
    import shutil as real_shutil

    from orchestrator.images import build as build_module
    from orchestrator.images import gc

    # the disk read as full makes a collection of tenants' images (test_image_gc.py), which here may take none
    monkeypatch.setattr(gc, "POLICY", gc.ImageGC(selects=re.compile(r"^$")))
    marker = uuid.uuid4().hex
    text = f"FROM {base_image}\nLABEL test.marker={marker}\n"
    total = 100 << 30
    full = real_shutil._ntuple_diskusage(total, total - (6 << 30), 6 << 30)  # type: ignore[attr-defined]
    monkeypatch.setattr(real_shutil, "disk_usage", lambda path: full)
    with pytest.raises(ImageBuildError, match=r"6144 MB free: a build that may write 2048 MB would leave less than"):
        _tenant_build(docker_client, "sec-room", text, tmp_path, BuildLimits(disk_mb=2048))
    assert _images_labelled(marker) == [] and not list((tmp_path / "logs").glob("*.log"))  # nothing was asked
    # room enough (5 GB kept of 100, past the build's 2 GB): it builds; and the logs folder keeps the newest
    monkeypatch.setattr(build_module, "MAX_BUILD_LOGS", 3)
    for n in range(5):
        (tmp_path / "logs" / f"old-{n}.log").write_text("x")
    roomy = real_shutil._ntuple_diskusage(total, total - (8 << 30), 8 << 30)  # type: ignore[attr-defined]
    monkeypatch.setattr(real_shutil, "disk_usage", lambda path: roomy)
    tag = _tenant_build(docker_client, "sec-room", text, tmp_path, BuildLimits(disk_mb=2048))
    try:
        assert len(list((tmp_path / "logs").glob("*.log"))) == 3  # two old ones and this build's
        # a tenant's image carries 96 bits of its key: its tag is trusted on a cache hit, and distinct names (a.b,
        # a_b) share a repository
        assert tag.startswith("envfleet/sec-room:") and len(tag.rsplit(":", 1)[1]) == 24
    finally:
        docker_client.images.remove(tag, force=True)


def test_build_logs_are_kept_within_a_byte_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # kept by count alone: 500 logs of a build's 64 MiB were 32 GiB of the host's disk, which no check of a build's
    # room counts (that is the engine's disk)
    import os

    from orchestrator.images import build as build_module

    monkeypatch.setattr(build_module, "BUILD_LOG_BYTES", (64 + 16) << 20)  # 16 MiB past the next build's room
    for n in range(10):
        path = tmp_path / f"b{n}.log"
        with path.open("wb") as f:
            f.truncate(8 << 20)
        os.utime(path, (1000 + n, 1000 + n))
    build_module._prune_logs(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.log")) == ["b8.log", "b9.log"]  # the newest, 16 MiB


def test_builds_running_at_once_count_each_others_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    # each build checked the floor alone: two a registration ran at once (its checks run in parallel) could write
    # twice the room between them, into what the sandboxes need
    import shutil as real_shutil

    from orchestrator.images import build as build_module

    class Engine:
        def info(self) -> dict[str, str]:
            return {"DockerRootDir": "/"}

        @property
        def api(self) -> Engine:  # what a collection of tenants' images reads: none here
            return self

        def containers(self, all: bool) -> list[str]:
            return []

        def images(self) -> list[str]:
            return []

    total = 100 << 30
    roomy = real_shutil._ntuple_diskusage(total, total - (8 << 30), 8 << 30)  # type: ignore[attr-defined]
    monkeypatch.setattr(real_shutil, "disk_usage", lambda path: roomy)
    limits = BuildLimits(disk_mb=2048)
    engine = cast(docker.DockerClient, Engine())
    # 8 GB free, 5 kept: room for one build of 2; the second waits for the first (a while at most), then goes
    monkeypatch.setattr(build_module, "ROOM_WAIT_S", 0.2)
    refused = pytest.raises(ImageBuildError, match="2048 MB and the builds running may write 2048 MB would leave")
    with build_module._room(engine, limits), refused, build_module._room(engine, limits):
        pass
    with build_module._room(engine, limits):  # the first one's end gave its room back
        pass
    monkeypatch.setattr(build_module, "ROOM_WAIT_S", 60.0)
    order: list[str] = []
    first_in = threading.Event()

    def first() -> None:
        with build_module._room(engine, limits):
            first_in.set()
            time.sleep(0.3)
            order.append("first ends")

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(5)
    with build_module._room(engine, limits):  # eight checks at once on room for four failed four: now they take turns
        order.append("second starts")
    thread.join(5)
    assert order == ["first ends", "second starts"]
    # alone it would not fit either: no wait, refused at once
    tight = real_shutil._ntuple_diskusage(total, total - (6 << 30), 6 << 30)  # type: ignore[attr-defined]
    monkeypatch.setattr(real_shutil, "disk_usage", lambda path: tight)
    started = time.monotonic()
    alone = pytest.raises(ImageBuildError, match="has 6144 MB free: a build that may write 2048 MB would leave")
    with alone, build_module._room(engine, limits):
        pass
    assert time.monotonic() - started < 5


def _tar(v7: bool = False) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as t:
        info = tarfile.TarInfo("f")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    data = bytearray(out.getvalue())
    if v7:  # the magic and version gone, the checksum made again over the header as it is now
        data[257:265] = bytes(8)
        data[148:156] = b" " * 8
        data[148:156] = b"%06o\0 " % sum(data[:512])
    return bytes(data)


@pytest.mark.parametrize(
    "archive",
    [
        b"\x1f\x8b\x08\x00" + bytes(40),  # gzip
        b"BZh91AY&SY" + bytes(40),  # bzip2
        b"\xfd7zXZ\x00" + bytes(40),  # xz
        b"\x28\xb5\x2f\xfd" + bytes(40),  # zstd
        _tar(),
        _tar(v7=True),  # no "ustar" magic: Go's reader takes it by its checksum
        (0x184D2A53).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"skip" + b"\x28\xb5\x2f\xfd",  # zstd
    ],
    ids=["gzip", "bzip2", "xz", "zstd", "tar", "tar-v7", "zstd-skippable-frame"],
)
def test_an_untrusted_build_that_adds_an_archive_is_refused_before_the_engine_sees_it(
    tmp_path: Path, archive: bytes
) -> None:
    # the engine unpacks an ADDed local archive itself, as root on the host, outside the build's memory and pids
    # limits and before the disk guard sees a layer: 16 MiB of xz can be hundreds of GiB unpacked
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "blob.bin").write_bytes(archive)  # by its bytes, not its name: the engine reads them
    (folder / "plain.txt").write_bytes(b"print(1)\n" * 100)  # and no plain file is taken for one
    with pytest.raises(InvalidRequestError, match=r"context file 'data/blob\.bin' is an archive .* use COPY"):
        build_image(
            None,  # type: ignore[arg-type]  # refused before any engine call
            name="t",
            dockerfile="FROM envfleet/base:latest\nADD data/ /x/\n",
            context_files={"data": folder},
            limits=BuildLimits(),
            from_images=["envfleet/base:latest"],
            adds=None,  # not said: taken to add (Harbor says, from its parse)
        )


@pytest.mark.parametrize(
    ("dockerfile", "adds"),
    [
        ("FROM envfleet/base:latest\nADD data/ /x/\n", True),
        ("FROM envfleet/base:latest\nadd \\\n b /x\n", True),
        ("FROM envfleet/base:latest\nAD\\\nD data /x\n", True),  # a continuation is joined with nothing between
        ("# escape=`\nFROM envfleet/base:latest\nAD`\nD data /x\n", True),
        ('FROM envfleet/base:latest\nADD ["data", "/x/"]\n', True),
        ("FROM envfleet/base:latest\nCOPY data /x\nRUN echo address\n", False),
    ],
)
def test_add_is_found_as_the_builder_reads_it(dockerfile: str, adds: bool) -> None:
    # split by a continuation, or under `# escape=`, ADD passed a line-by-line regex (Harbor's build gives this)
    from orchestrator.service.declarative.dockerfile import adds as has_add

    assert has_add(dockerfile) is adds


def test_the_build_guard_dates_a_build_by_the_engines_clock() -> None:
    # a build's step containers and layers are stamped by the engine: compared with this host's clock, an engine
    # whose clock is behind (a remote one, a clock set back) made every step look older than the build, none was
    # watched, and the tenant's build disk limit was never enforced
    from orchestrator.images.disk_guard import _engine_now

    class Engine:
        def __init__(self, stamp: str) -> None:
            self.stamp = stamp

        def info(self) -> dict[str, str]:
            return {"SystemTime": self.stamp}

    behind = time.time() - 600
    utc = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(behind)) + ".123456789Z"
    assert abs(_engine_now(cast(docker.DockerClient, Engine(utc))) - behind) < 1.0
    zoned = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(behind + 3600)) + ".5+01:00"  # its zone's wall time
    assert abs(_engine_now(cast(docker.DockerClient, Engine(zoned))) - behind) < 1.0
    assert abs(_engine_now(cast(docker.DockerClient, Engine("no time"))) - time.time()) < 1.0  # this host's
