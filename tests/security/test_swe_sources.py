"""SWE instance sources are task content (third-party datasets): fetching one runs nothing of it on the host (an
sdist is read from the package index as a file, never prepared by pip, whose metadata step runs the sdist's build
backend), a host path must be a regular file of bounded size, and a prebuilt image must be an envfleet SWE image."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal

import docker
import pytest

from environments.swe.images import fetch_source, instance_image
from environments.swe.instance import ArchiveSource, ImageSource, SdistSource, SweInstance
from orchestrator.core.errors import ImageBuildError, InvalidRequestError

IndexFormat = Literal["json", "html"]
JSON_TYPE = "application/vnd.pypi.simple.v1+json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _targz(files: dict[str, str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _hostile_sdist(canary: Path) -> bytes:
    """An sdist whose in-tree PEP 517 backend (and setup.py, for a legacy path) writes `canary` when loaded, and
    otherwise answers pip's metadata hooks, so that pip's `download` goes through."""
    plant = f"import os, pathlib\npathlib.Path({str(canary)!r}).write_text(f'ran as uid {{os.getuid()}}')\n"
    backend = plant + (
        "def get_requires_for_build_wheel(config_settings=None):\n    return []\n"
        "def get_requires_for_build_sdist(config_settings=None):\n    return []\n"
        "def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):\n"
        "    d = pathlib.Path(metadata_directory) / 'envfleet_canary-1.0.dist-info'\n"
        "    d.mkdir()\n"
        "    (d / 'METADATA').write_text('Metadata-Version: 2.1\\nName: envfleet-canary\\nVersion: 1.0\\n')\n"
        "    return d.name\n"
        "def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):\n"
        "    raise RuntimeError('not built here')\n"
    )
    return _targz(
        {
            "envfleet_canary-1.0/PKG-INFO": "Metadata-Version: 2.1\nName: envfleet-canary\nVersion: 1.0\n",
            "envfleet_canary-1.0/pyproject.toml": (
                '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
            ),
            "envfleet_canary-1.0/backend.py": backend,
            "envfleet_canary-1.0/setup.py": plant + "from setuptools import setup\nsetup()\n",
        }
    )


@dataclass
class _File:
    data: bytes
    listed_sha256: str  # what the listing says (a lying index says the pin)
    content_length: bool = True  # False: no Content-Length, the body ends when the connection closes


@dataclass
class LoopbackIndex:
    """A package index on loopback (PEP 691 JSON when asked for it, else PEP 503 HTML) serving in-memory files."""

    url: str
    fmt: IndexFormat
    projects: dict[str, dict[str, _File]] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)

    def add(self, project: str, filename: str, data: bytes, *, listed_sha256: str = "", length: bool = True) -> None:
        """Serve `data` as `filename` of `project` (listed with its digest unless `listed_sha256` says another)."""
        self.projects.setdefault(project, {})[filename] = _File(data, listed_sha256 or _sha256(data), length)

    def file_requests(self) -> list[str]:
        return [p for p in self.requests if p.startswith("/files/")]


def _serve(index: LoopbackIndex) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            index.requests.append(self.path)
            parts = self.path.strip("/").split("/")
            if len(parts) == 2 and parts[0] == "simple" and parts[1] in index.projects:
                self._page(parts[1], index.projects[parts[1]])
            elif len(parts) == 2 and parts[0] == "files":
                found = [f for files in index.projects.values() for n, f in files.items() if n == parts[1]]
                if not found:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                if found[0].content_length:
                    self.send_header("Content-Length", str(len(found[0].data)))
                self.end_headers()
                self.wfile.write(found[0].data)
            else:
                self.send_error(404)

        def _page(self, project: str, files: dict[str, _File]) -> None:
            # relative file URLs, as a mirror may give them: the client resolves them against the page
            if index.fmt == "json" and JSON_TYPE in self.headers.get("Accept", ""):
                body = json.dumps(
                    {
                        "meta": {"api-version": "1.1"},
                        "name": project,
                        "files": [
                            {"filename": n, "url": f"../../files/{n}", "hashes": {"sha256": f.listed_sha256}}
                            for n, f in files.items()
                        ],
                    }
                ).encode()
                ctype = JSON_TYPE
            else:
                links = "".join(
                    f'<a href="../../files/{n}#sha256={f.listed_sha256}">{n}</a><br/>\n' for n, f in files.items()
                )
                body = f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode()
                ctype = "text/html"
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@pytest.fixture
def loopback_index(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[IndexFormat], LoopbackIndex]]:
    """Start a loopback index and point PIP_INDEX_URL (which both pip and the fetch read) at it."""
    servers: list[ThreadingHTTPServer] = []

    def start(fmt: IndexFormat) -> LoopbackIndex:
        index = LoopbackIndex(url="", fmt=fmt)
        server = ThreadingHTTPServer(("127.0.0.1", 0), _serve(index))
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        index.url = f"http://127.0.0.1:{server.server_address[1]}/simple/"
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        return index

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("fmt", ["json", "html"])
def test_an_sdist_is_fetched_without_running_any_of_it(
    loopback_index: Callable[[IndexFormat], LoopbackIndex], tmp_path: Path, fmt: IndexFormat
) -> None:
    canary = tmp_path / "canary"
    data = _hostile_sdist(canary)
    index = loopback_index(fmt)
    index.add("envfleet-canary", "envfleet_canary-1.0.tar.gz", data)
    source = SdistSource(
        package="envfleet-canary", version="1.0", filename="envfleet_canary-1.0.tar.gz", sha256=_sha256(data)
    )
    got = fetch_source(source, tmp_path / "cache")
    assert not canary.exists(), f"the sdist's build backend ran on the host ({canary.read_text()})"
    assert got.read_bytes() == data and got.is_relative_to(tmp_path / "cache")
    # cached by its digest: a second fetch asks the index nothing
    asked = len(index.requests)
    assert fetch_source(source, tmp_path / "cache") == got and len(index.requests) == asked


def test_an_sdist_that_does_not_match_its_pin_is_refused(
    loopback_index: Callable[[IndexFormat], LoopbackIndex], tmp_path: Path
) -> None:
    index = loopback_index("json")
    pinned = _targz({"p-1.0/p.py": "x = 1\n"})
    other = _targz({"p-1.0/p.py": "import os; os.system('echo pwned')\n"})
    source = SdistSource(package="p", version="1.0", filename="p-1.0.tar.gz", sha256=_sha256(pinned))
    # the index lists another digest: refused before anything is downloaded
    index.add("p", "p-1.0.tar.gz", other)
    with pytest.raises(ImageBuildError, match=rf"lists p-1.0.tar.gz with sha256 {_sha256(other)}, not the pinned"):
        fetch_source(source, tmp_path / "cache")
    assert index.file_requests() == []
    # the index lists the pin but serves other bytes: refused after the download, and nothing is cached
    index.add("p", "p-1.0.tar.gz", other, listed_sha256=_sha256(pinned))
    with pytest.raises(ImageBuildError, match=rf"p-1.0.tar.gz from .* has sha256 {_sha256(other)}, not the pinned"):
        fetch_source(source, tmp_path / "cache")
    assert index.file_requests() == ["/files/p-1.0.tar.gz"]
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.suffix != ".lock"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("served", "version", "filename", "length", "error"),
    [
        ({}, "1.0", "q-1.0.tar.gz", True, r"the index http://\S+ has no project 'q'"),
        ({"q-2.0.tar.gz": 100}, "1.0", "q-1.0.tar.gz", True, r"has no version 1.0 of q \(it has 2.0\)"),
        ({"q-1.0-py3-none-any.whl": 100}, "1.0", "q-1.0.tar.gz", True, r"no file q-1.0.tar.gz for q 1.0 \(it has q-1"),
        ({"q-1.0.tar.gz": 5000}, "1.0", "q-1.0.tar.gz", True, r"q-1.0.tar.gz is over 4096 bytes"),
        ({"q-1.0.tar.gz": 5000}, "1.0", "q-1.0.tar.gz", False, r"q-1.0.tar.gz is over 4096 bytes"),
    ],
    ids=["no project", "no such version", "no sdist", "too large", "too large, unannounced"],
)
def test_sdist_refusals_say_what_is_wrong(
    loopback_index: Callable[[IndexFormat], LoopbackIndex],
    tmp_path: Path,
    served: dict[str, int],
    version: str,
    filename: str,
    length: bool,
    error: str,
) -> None:
    index = loopback_index("json")
    pin = "0" * 64
    for name, size in served.items():  # listed with the pin, so that only what is tested refuses it
        index.add("q", name, os.urandom(size), listed_sha256=pin, length=length)
    source = SdistSource(package="q", version=version, filename=filename, sha256=pin)
    with pytest.raises(ImageBuildError, match=error):
        fetch_source(source, tmp_path / "cache", max_bytes=4096)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.suffix != ".lock"]


def test_an_index_token_stays_out_of_errors(
    loopback_index: Callable[[IndexFormat], LoopbackIndex], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = loopback_index("json")
    monkeypatch.setenv("PIP_INDEX_URL", index.url.replace("http://", "http://ci:s3cret-token@"))
    source = SdistSource(package="q", version="1.0", filename="q-1.0.tar.gz", sha256="0" * 64)
    with pytest.raises(ImageBuildError, match=r"the index http://127\.0\.0\.1:\d+/simple/ has no project") as caught:
        fetch_source(source, tmp_path / "cache")
    assert "s3cret-token" not in str(caught.value)


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "archive.tar.gz")
    return tmp / "archive.tar.gz"


def _link_to_fifo(tmp: Path) -> Path:
    (tmp / "link.tar.gz").symlink_to(_fifo(tmp))
    return tmp / "link.tar.gz"


def _sparse(tmp: Path) -> Path:
    """A regular file of 1 TiB that takes no disk: hashed whole, it holds the fetch for many minutes."""
    path = tmp / "huge.tar.gz"
    with path.open("wb") as f:
        f.truncate(1 << 40)
    return path


@pytest.mark.timeout(20)  # a fetch that opens or reads what it should refuse hangs; this ends it as a failure
@pytest.mark.parametrize(
    ("make", "error"),
    [
        (_fifo, r"archive\.tar\.gz is not a regular file \(a FIFO\)"),
        (lambda _: Path("/dev/zero"), r"/dev/zero is not a regular file \(a character device\)"),
        (_link_to_fifo, r"link\.tar\.gz \(a link to .*archive\.tar\.gz\) is not a regular file \(a FIFO\)"),
        (_sparse, r"huge\.tar\.gz is 1099511627776 bytes, over the cap of \d+"),
        (lambda tmp: tmp / "absent.tar.gz", r"absent\.tar\.gz does not exist"),
    ],
    ids=["fifo", "dev-zero", "link", "sparse-1TiB", "absent"],
)
def test_an_archive_path_that_is_not_a_regular_file_is_refused_at_once(
    tmp_path: Path, make: Callable[[Path], Path], error: str
) -> None:
    source = ArchiveSource(path=make(tmp_path), sha256="0" * 64)
    with pytest.raises(InvalidRequestError, match=error):
        fetch_source(source, tmp_path / "cache")


def test_an_archive_is_checked_and_copied_into_the_cache(tmp_path: Path) -> None:
    data = _targz({"r-1.0/r.py": "x = 1\n"})
    path = tmp_path / "r-1.0.tar.gz"
    path.write_bytes(data + b"\0")
    # the digest of an arbitrary host file is not echoed back: a dataset must not learn it from an error
    with pytest.raises(InvalidRequestError, match=r"r-1\.0\.tar\.gz does not match its sha256 [0-9a-f]{64}$"):
        fetch_source(ArchiveSource(path=path, sha256=_sha256(data)), tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.suffix != ".lock"]
    path.write_bytes(data)
    got = fetch_source(ArchiveSource(path=path, sha256=_sha256(data)), tmp_path / "cache")
    # the build reads the host-owned copy, never the dataset's path again
    assert got.is_relative_to(tmp_path / "cache") and got.read_bytes() == data
    # a link to the file, as the Hugging Face hub's and DVC's caches hand out, is followed to it
    (tmp_path / "linked.tar.gz").symlink_to(path)
    linked = fetch_source(ArchiveSource(path=tmp_path / "linked.tar.gz", sha256=_sha256(data)), tmp_path / "cache")
    assert linked.read_bytes() == data


def _instance(image: str) -> SweInstance:
    return SweInstance(
        instance_id="sources-test-1",
        repo="local/x",
        base_commit="0" * 40,
        problem_statement="p",
        patch="diff",
        FAIL_TO_PASS=["t"],
        version="1",
        environment_setup_commit="0" * 40,
        source=ImageSource(image=image),
    )


@pytest.mark.parametrize(
    "image",
    ["swe-sources-test/foreign:1", "envfleet/env-swe-sources-victim:1", "envfleet/base:latest"],
    ids=["foreign", "another-environment", "envfleet-not-swe"],
)
def test_an_image_source_must_be_an_envfleet_swe_image(
    docker_client: docker.DockerClient, base_image: str, image: str
) -> None:
    made = image != "envfleet/base:latest"
    if made:  # the image exists, so only the name can refuse it
        repo, _, tag = image.rpartition(":")
        docker_client.images.get(base_image).tag(repo, tag)
    try:
        with pytest.raises(InvalidRequestError, match=r"only envfleet SWE images \(envfleet/swe/\.\.\.\) may be"):
            instance_image(docker_client, _instance(image))
    finally:
        if made:
            docker_client.images.remove(image, noprune=True)


def test_an_envfleet_swe_image_source_is_used(docker_client: docker.DockerClient, base_image: str) -> None:
    docker_client.images.get(base_image).tag("envfleet/swe/sources-test", "1")
    try:
        assert instance_image(docker_client, _instance("envfleet/swe/sources-test:1")) == "envfleet/swe/sources-test:1"
    finally:
        docker_client.images.remove("envfleet/swe/sources-test:1", noprune=True)
