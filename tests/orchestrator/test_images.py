"""The offline image pipeline: ImageSpec validation and rendering, input hashing, and real builds on the engine."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import http.server
import json
import socketserver
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest
from pydantic import ValidationError

from orchestrator.core.environment import Environment
from orchestrator.core.errors import EngineError, ImageBuildError, InvalidRequestError
from orchestrator.core.image_spec import ImageSpec, render_dockerfile
from orchestrator.core.models import RolloutStatus
from orchestrator.images import build_image, ensure_base_image
from orchestrator.images.base import BASE_LATEST
from orchestrator.images.build import BuildLimits, image_key
from orchestrator.images.resolver import BuildsOwnImage, ImageResolver
from orchestrator.rollout.step import classify_failure
from orchestrator.service.registry import Registry


@pytest.fixture
def created_images(docker_client: docker.DockerClient) -> Iterator[list[str]]:
    """Tags a test built; removed afterwards so the suite leaves no images behind."""
    tags: list[str] = []
    yield tags
    for tag in tags:
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(tag)


# --- ImageSpec and the Dockerfile it renders (no engine needed) ---


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("etc/motd", "must be absolute"),
        ("./motd", "must be absolute"),
        ("/etc/../root/.bashrc", "must not contain '..'"),
        ("/..", "must not contain '..'"),
        ("/home/$USER/x", r"must not contain '\$'"),
        ("/etc/", "must name a file"),
    ],
)
def test_image_spec_rejects_bad_file_paths(path: str, why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        ImageSpec(base="envfleet/base:latest", files={path: "x"})


def test_image_spec_rejects_unknown_fields_and_relative_workdir() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        ImageSpec.model_validate({"base": "envfleet/base:latest", "cmd": ["true"]})
    with pytest.raises(ValidationError, match="workdir 'src' must be absolute"):
        ImageSpec(base="envfleet/base:latest", workdir="src")
    with pytest.raises(ValidationError, match="not a shell variable name"):
        ImageSpec(base="envfleet/base:latest", env={"A-B": "1"})


def test_render_dockerfile_orders_env_workdir_copy_run() -> None:
    spec = ImageSpec(
        base="envfleet/base:latest",
        env={"GREETING": 'say "hi" to $USER\\'},
        workdir="/srv/app",
        files={"/srv/app/a b.txt": "hello\n"},
        run=["echo one", "if true; then\n  echo two\nfi"],
    )
    dockerfile, context = render_dockerfile(spec)
    assert dockerfile.splitlines() == [
        "FROM envfleet/base:latest",
        'ENV GREETING="say \\"hi\\" to \\$USER\\\\"',
        "WORKDIR /srv/app",
        'COPY ["files/0", "/srv/app/a b.txt"]',
        "RUN echo one",
        'RUN ["/bin/sh", "-c", "if true; then\\n  echo two\\nfi"]',
    ]
    assert context == {"files/0": b"hello\n"}


def test_image_key_covers_folder_contents_and_modes(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    script = tmp_path / "pkg" / "run.sh"
    script.write_text("echo hi\n")
    files = {"app": tmp_path}
    key = image_key("FROM scratch\n", files)
    assert image_key("FROM scratch\n", files) == key
    script.chmod(0o755)
    key_exec = image_key("FROM scratch\n", files)
    assert key_exec != key
    script.write_text("echo bye\n")
    assert image_key("FROM scratch\n", files) != key_exec
    assert image_key("FROM scratch\n", files, buildargs={"A": "1"}) != image_key("FROM scratch\n", files)


def test_build_image_rejects_escaping_context_paths(docker_client: docker.DockerClient) -> None:
    with pytest.raises(InvalidRequestError, match=r"must be relative, without '\.\.'"):
        build_image(docker_client, name="never-built", dockerfile="FROM scratch\n", context_files={"../x": b""})
    with pytest.raises(InvalidRequestError, match="image name 'Bad Name'"):
        build_image(docker_client, name="Bad Name", dockerfile="FROM scratch\n", context_files={})


# --- real builds on the engine ---


@pytest.mark.docker
def test_base_image_cache_hit_is_fast_and_does_not_rebuild(docker_client: docker.DockerClient, base_image: str) -> None:
    assert base_image.startswith("envfleet/base:")
    before = docker_client.images.get(base_image)
    t0 = time.monotonic()
    again = ensure_base_image(docker_client)
    elapsed = time.monotonic() - t0
    assert again == base_image
    assert elapsed < 2.0, f"cache hit took {elapsed:.2f} s"
    after = docker_client.images.get(again)
    assert after.id == before.id
    assert after.attrs["Created"] == before.attrs["Created"]
    assert docker_client.images.get("envfleet/base:latest").id == before.id
    assert after.labels.get("envfleet.envd") == "1"


@pytest.mark.docker
def test_an_existing_base_image_is_found_without_go_and_carries_the_compiled_envd(
    docker_client: docker.DockerClient, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the orchestrator's own image has no Go: the base image is keyed by envd's Go sources (a label), and the
    # binary is made only when the image is built
    from orchestrator.images import base, envd_go

    def no_go(*args: object) -> str:
        raise AssertionError("the compiled envd was built for an image that exists")

    monkeypatch.setattr(envd_go, "_toolchain", no_go)
    monkeypatch.setattr(base, "build_envd_binary", no_go)
    assert ensure_base_image(docker_client) == base_image
    labels = docker_client.images.get(base_image).labels
    assert labels["envfleet.envd-go"] == envd_go.inputs_key()
    out = docker_client.containers.run(
        base_image, ["/opt/envfleet/bin/envd", "--help"], remove=True, network_disabled=True
    )
    assert b"usage: envd" in out


@pytest.mark.docker
def test_build_spec_from_base_adds_files_env_and_runs_commands(
    docker_client: docker.DockerClient, base_image: str, created_images: list[str]
) -> None:
    nonce = uuid.uuid4().hex  # a fresh hash, so this really builds
    spec = ImageSpec(
        base=base_image,
        files={"/etc/envfleet-test/hello.txt": f"hello {nonce}\n"},
        env={"GREETING": 'a "quoted" $value'},
        workdir="/srv/app",
        run=['cp /etc/envfleet-test/hello.txt copied.txt && printf %s "$GREETING" > greeting.txt'],
    )
    dockerfile, context = render_dockerfile(spec)
    tag = build_image(docker_client, name="test-images-spec", dockerfile=dockerfile, context_files=dict(context))
    created_images.append(tag)
    assert tag.startswith("envfleet/test-images-spec:")

    out = docker_client.containers.run(
        tag,
        ["sh", "-c", "cat /etc/envfleet-test/hello.txt copied.txt greeting.txt; echo; pwd; id -u"],
        network_mode="none",
        user="1000",
        remove=True,
    )
    assert out.decode().splitlines() == [f"hello {nonce}", f"hello {nonce}", 'a "quoted" $value', "/srv/app", "1000"]

    t0 = time.monotonic()
    again = build_image(docker_client, name="test-images-spec", dockerfile=dockerfile, context_files=dict(context))
    assert again == tag
    assert time.monotonic() - t0 < 2.0


@pytest.mark.docker
async def test_an_image_spec_without_a_base_is_built_on_the_base_image(
    docker_client: docker.DockerClient, base_image: str, created_images: list[str]
) -> None:
    # the base was a required field, so the resolver's "no base: the base image" never ran; an author hard-coded
    # envfleet/base:latest, which ensure_base_image never builds
    nonce = uuid.uuid4().hex

    class Spec(Environment):
        name = "test-images-no-base"

        def tasks(self) -> list[Any]:
            return []

        def image_spec(self) -> ImageSpec:
            return ImageSpec(files={"/etc/envfleet-test/nonce": nonce})

    tag, _ = await ImageResolver(docker_client).resolve(Spec())
    created_images.append(tag)
    history = [layer["Id"] for layer in docker_client.api.history(tag)]
    assert docker_client.images.get(base_image).id in history
    with pytest.raises(ValueError, match="base is given before it is rendered"):
        render_dockerfile(ImageSpec())


@pytest.mark.docker
def test_failing_run_raises_naming_the_step(docker_client: docker.DockerClient, base_image: str) -> None:
    spec = ImageSpec(base=base_image, run=["exit 3"])
    dockerfile, context = render_dockerfile(spec)
    with pytest.raises(ImageBuildError, match=r"failed at 'Step 2/2 : RUN exit 3'") as info:
        build_image(docker_client, name="test-images-fail", dockerfile=dockerfile, context_files=dict(context))
    err = info.value
    assert err.step == "Step 2/2 : RUN exit 3"
    assert "returned a non-zero code: 3" in str(err)
    assert err.log_path is not None and "RUN exit 3" in err.log_path.read_text()
    # forcerm: the failed step's container is gone
    # (the low-level list: other tests' sandboxes of the same image may vanish between a list and an inspect)
    left = docker_client.api.containers(all=True, filters={"ancestor": base_image})
    assert not [c for c in left if "exit 3" in (c.get("Command") or "")]


def test_an_image_built_from_a_moving_tag_is_rebuilt_when_the_tag_moves(
    docker_client: docker.DockerClient, base_image: str
) -> None:
    # `FROM envfleet/base:latest` names whatever base the engine has now: a cache keyed by the Dockerfile's text
    # alone handed out images on an old envd after the base changed
    moving = f"envfleet/test-moving-{uuid.uuid4().hex[:8]}"
    made: list[str] = []
    try:
        docker_client.images.get(base_image).tag(moving, "latest")
        dockerfile = f"FROM {moving}:latest\n"
        made.append(build_image(docker_client, name="test-moving-child", dockerfile=dockerfile, context_files={}))
        other = build_image(
            docker_client, name="test-moving-other", dockerfile=f"FROM {base_image}\nLABEL moved=1\n", context_files={}
        )
        made.append(other)
        docker_client.images.get(other).tag(moving, "latest")
        made.append(build_image(docker_client, name="test-moving-child", dockerfile=dockerfile, context_files={}))
        assert made[2] != made[0], "the child of a moved tag must be a new image"
    finally:
        for tag in [*made, f"{moving}:latest"]:
            with contextlib.suppress(docker.errors.DockerException):
                docker_client.images.remove(tag, noprune=True)


class _EngineAnswering(http.server.BaseHTTPRequestHandler):
    """An engine that answers every call with the server's `code` (a 5xx: the engine itself failing); "build":
    no image exists, and the build itself fails."""

    def _answer(self) -> None:
        body = b'{"message": "write /var/lib/docker/tmp: no space left on device"}'
        code = self.server.code  # type: ignore[attr-defined]
        if code == "midway":
            return self._midway()
        if code == "build" and self.command == "GET":  # no such image yet: it is to be built
            code, body = 404, b'{"message": "No such image"}'
        self.send_response(500 if code == "build" else code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _midway(self) -> None:
        """ "midway": a build that commits a layer, then the engine goes away (its answer cut short); the calls to
        remove an image are recorded on the server's `deleted`."""
        if self.command == "DELETE":
            self.server.deleted.append(self.path)  # type: ignore[attr-defined]
        if self.command == "POST" and "/build" in self.path:
            steps = ["Step 1/2 : FROM envfleet/base", " ---> 0123456789ab", "Step 2/2 : RUN make"]
            steps += [" ---> Running in c0ffee0c0ffe", " ---> ba9876543210"]
            self.protocol_version = "HTTP/1.1"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for line in steps:
                data = json.dumps({"stream": f"{line}\n"}).encode() + b"\r\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()  # and no last chunk: the connection ends
            self.close_connection = True
            return
        code, body = (200, b'[{"Size": 1}]') if "/history" in self.path else (404, b'{"message": "No such image"}')
        # the base, and the layer the build committed on it (the guard checks a layer's parent and age on the engine)
        base, layer = "sha256:0123456789ab" + "0" * 52, "sha256:ba9876543210" + "0" * 52
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        images = {
            "/images/envfleet/base/json": {"Id": base, "Parent": "", "Created": "2026-01-01T00:00:00Z"},
            "/images/ba9876543210/json": {"Id": layer, "Parent": base, "Created": now},
        }
        if self.command == "GET" and self.path.split("?")[0].removeprefix("/v1.41") in images:
            code, body = 200, json.dumps(images[self.path.split("?")[0].removeprefix("/v1.41")]).encode()
        if self.command == "DELETE":
            code, body = 200, b"[]"
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_HEAD = do_DELETE = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _engine(path: Path, code: int | str, deleted: list[str] | None = None) -> Iterator[str]:
    server = socketserver.ThreadingUnixStreamServer(str(path), _EngineAnswering)
    server.code = code  # type: ignore[attr-defined]
    server.deleted = [] if deleted is None else deleted  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"unix://{path}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_the_engine_failing_a_call_is_infrastructure_not_the_environments_fault(tmp_path: Path) -> None:
    # an ENV_ERROR is never retried and tells the trainer the environment is broken: an engine out of disk or gone
    # is neither (the rollout is retried as INFRA_ERROR, within the job's budget)
    env = Registry.from_entry_points().get("python-tool")
    with _engine(tmp_path / "engine.sock", 500) as url:
        resolver = ImageResolver(docker.DockerClient(base_url=url, version="1.41", timeout=10))
        with pytest.raises(EngineError, match="no space left on device") as failed:
            await resolver.resolve(env)
    assert classify_failure(failed.value)[0] == RolloutStatus.INFRA_ERROR
    gone = ImageResolver(docker.DockerClient(base_url=f"unix://{tmp_path / 'no-engine.sock'}", version="1.41"))
    with pytest.raises(EngineError, match="did not answer"):
        await gone.resolve(env)


async def test_a_waiter_cancelled_during_a_build_leaves_the_one_build_to_the_next(tmp_path: Path) -> None:
    # under a per-image lock, a waiter cancelled (a rollout's timeout, a CancelJob) let the next start a second build
    # beside the first, which ran on in its thread and was thrown away: under retries, builds of one image piled up
    env = Registry.from_entry_points().get("python-tool")
    started: list[float] = []
    release = threading.Event()

    class Counting(ImageResolver):
        def _build(self, env: Environment) -> tuple[str, str]:
            started.append(time.monotonic())
            release.wait(30)
            return "env-python-tool:abc", "sha256:abc"

    resolver = Counting(docker.DockerClient(base_url=f"unix://{tmp_path / 'unused.sock'}", version="1.41"))
    first = asyncio.create_task(resolver.resolve(env))
    await asyncio.sleep(0.2)
    first.cancel()
    second = asyncio.create_task(resolver.resolve(env))
    await asyncio.sleep(0.2)
    release.set()
    assert await second == ("env-python-tool:abc", "sha256:abc")
    assert len(started) == 1 and first.cancelled()
    assert await resolver.resolve(env) == ("env-python-tool:abc", "sha256:abc") and len(started) == 1  # cached


def test_the_engine_failing_a_build_is_infrastructure_too(tmp_path: Path) -> None:
    with _engine(tmp_path / "engine.sock", "build") as url:
        client = docker.DockerClient(base_url=url, version="1.41", timeout=10)
        with pytest.raises(EngineError, match=r"the engine failed: .*no space left on device"):
            build_image(client, name="engine-down", dockerfile="FROM scratch\n", context_files={}, cache_dir=tmp_path)


def test_a_build_the_engine_failed_midway_leaves_no_layers(tmp_path: Path) -> None:
    # the engine's failures were raised before the build's layers were removed: the steps it had committed stayed on
    # disk as untagged images
    deleted: list[str] = []
    with _engine(tmp_path / "engine.sock", "midway", deleted) as url:
        client = docker.DockerClient(base_url=url, version="1.41", timeout=10)
        with pytest.raises(EngineError, match="did not answer"):
            build_image(
                client,
                name="engine-gone",
                dockerfile="FROM envfleet/base\nRUN make\n",
                context_files={},
                cache_dir=tmp_path,
                limits=BuildLimits(),
            )
    assert [p.split("?")[0].rsplit("/", 1)[-1] for p in deleted] == ["sha256:ba9876543210" + "0" * 52]


def test_an_environments_own_image_is_built_when_latest_names_this_installs_base(
    docker_client: docker.DockerClient, base_image: str
) -> None:
    # only a build of the base moved `envfleet/base:latest`: after an upgrade, a declarative spec's or an archive's
    # image (FROM envfleet/base:latest) was built on the base of the install before, its envd the old one
    dockerfile = f"FROM {base_image}\nLABEL older=1\n"
    older = build_image(docker_client, name="test-older-base", dockerfile=dockerfile, context_files={})
    seen: list[str] = []

    class Own(BuildsOwnImage):
        def build_image(self, client: docker.DockerClient) -> str:
            seen.append(str(client.images.get(BASE_LATEST).id))
            return base_image

    try:
        docker_client.images.get(older).tag(BASE_LATEST.split(":")[0], "latest")  # an older install's base
        assert ImageResolver(docker_client).build_own_image(Own()) == base_image
        assert seen == [docker_client.images.get(base_image).id]
    finally:
        docker_client.images.get(base_image).tag(BASE_LATEST.split(":")[0], "latest")
        with contextlib.suppress(docker.errors.DockerException):
            docker_client.images.remove(older, noprune=True)
