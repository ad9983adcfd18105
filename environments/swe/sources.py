"""SWE sources onto the host without running any of them: an instance's `source` is task content (a third-party
dataset), so it is read as bytes, never executed.

- A pinned sdist is looked up in the package index's Simple API (PEP 691 JSON, or PEP 503 HTML) and downloaded as a
  file with httpx. pip is never asked: `pip download` of an sdist prepares its metadata, which runs the sdist's
  setup.py or build backend on the host.
- A local archive must be a regular file, or a link to one (checked with lstat before it is opened, so no device is
  opened and no FIFO waited on), of bounded size.

Both are written next to their cache entry, hashed as they are written, and moved into place only when their sha256
is the pinned one. The index is `PIP_INDEX_URL` when set (as pip would use), else PyPI; pip's config files are not
read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, BinaryIO

import httpx
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from environments.swe.instance import ArchiveSource, SdistSource
from orchestrator.core.echo import echo
from orchestrator.core.errors import ImageBuildError, InvalidRequestError

DEFAULT_INDEX_URL = "https://pypi.org/simple/"
INDEX_URL_ENV = "PIP_INDEX_URL"
MAX_SOURCE_BYTES = 512 << 20  # an sdist or archive; PyPI's own upload limit is 100 MB unless raised for a project
MAX_PAGE_BYTES = 64 << 20  # a project's index page (the largest PyPI projects list tens of thousands of files)
FETCH_TIMEOUT_S = 600.0  # the whole fetch; a server that drips bytes gets no longer
READ_TIMEOUT_S = 60.0
_STEP = "fetch sdist"
_JSON = "application/vnd.pypi.simple.v1+json"
_ACCEPT = f"{_JSON}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
_CHUNK = 1 << 20


def index_url() -> str:
    """The package index's Simple API root: `PIP_INDEX_URL`, else PyPI's."""
    return os.environ.get(INDEX_URL_ENV, "").strip() or DEFAULT_INDEX_URL


@dataclass(frozen=True)
class IndexFile:
    """One file of a project as the index lists it."""

    filename: str
    url: httpx.URL
    sha256: str | None
    size: int | None


def fetch_sdist(
    source: SdistSource,
    dest: Path,
    *,
    index: str | None = None,
    max_bytes: int = MAX_SOURCE_BYTES,
    timeout_s: float = FETCH_TIMEOUT_S,
) -> None:
    """Download `source.filename` of `source.package` from the index to `dest`, which it reaches only with the
    pinned sha256. Raises ImageBuildError saying what is wrong (no such project, version or file, a digest that
    differs, a file over `max_bytes`, an index that cannot be read)."""
    root = index or index_url()
    shown = _redacted(root)
    deadline = time.monotonic() + timeout_s
    try:
        with httpx.Client(timeout=READ_TIMEOUT_S, follow_redirects=True) as client:
            file = _find(client, source, _page_url(root), shown, max_bytes, deadline)
            with client.stream("GET", file.url) as r:
                if r.status_code != 200:
                    raise ImageBuildError(f"{_redacted(file.url)} answered HTTP {r.status_code}", step=_STEP)
                length = r.headers.get("content-length", "")
                if length.isdigit() and int(length) > max_bytes:
                    raise _too_large(source.filename, max_bytes)
                with _staging(dest) as tmp:
                    written = _write(_until(r.iter_bytes(_CHUNK), deadline), tmp, max_bytes)
                    if written is None:
                        raise _too_large(source.filename, max_bytes)
                    if written != source.sha256:
                        raise ImageBuildError(
                            f"{source.filename} from {_redacted(file.url)} has sha256 {written}, "
                            f"not the pinned {source.sha256}",
                            step=_STEP,
                        )
                    os.replace(tmp, dest)
    except httpx.HTTPError as e:  # mapped once, here: every network failure names the index
        raise ImageBuildError(f"cannot fetch {source.package}=={source.version} from {shown}: {e}", step=_STEP) from e


def _redacted(url: httpx.URL | str) -> str:
    """`url` without its user and password (an index URL may carry a token), for messages."""
    u = httpx.URL(str(url))
    return str(u.copy_with(username=None, password=None)) if u.userinfo else str(u)


def _page_url(root: str) -> httpx.URL:
    base = httpx.URL(root.rstrip("/") + "/")
    if base.scheme not in ("http", "https"):
        raise ImageBuildError(
            f"{INDEX_URL_ENV} {echo(_redacted(root))} must be an http(s) URL of a Simple API", step=_STEP
        )
    return base


def _find(
    client: httpx.Client, source: SdistSource, base: httpx.URL, root: str, max_bytes: int, deadline: float
) -> IndexFile:
    """The index's entry for `source.filename`, its listed digest and size checked against the pin and the cap
    (`root`: the index as messages show it)."""
    url = base.join(f"{canonicalize_name(source.package)}/")
    with client.stream("GET", url, headers={"Accept": _ACCEPT}) as r:
        if r.status_code == 404:
            raise ImageBuildError(f"the index {root} has no project {source.package!r}", step=_STEP)
        if r.status_code != 200:
            raise ImageBuildError(f"the index {root} answered HTTP {r.status_code} for {_redacted(url)}", step=_STEP)
        body = bytearray()
        for chunk in _until(r.iter_bytes(_CHUNK), deadline):
            body += chunk
            if len(body) > MAX_PAGE_BYTES:
                raise ImageBuildError(f"the index page {_redacted(url)} is over {MAX_PAGE_BYTES} bytes", step=_STEP)
        json_page = r.headers.get("content-type", "").split(";")[0].strip() == _JSON
        files = _json_files(bytes(body), r.url) if json_page else _html_files(bytes(body), r.url)
    # by the name, else by the pinned digest among this release's sdists, as pip's --require-hashes matched (an old
    # dataset may spell the name otherwise than the index does: foo-1.0.tar.gz for Foo-1.0.tar.gz)
    found = [f for f in files if f.filename == source.filename] or [
        f for f in files if f.sha256 == source.sha256 and _release_sdist(f.filename, source)
    ]
    if not found:
        raise ImageBuildError(_missing(source, files, root), step=_STEP)
    file = found[0]
    if file.url.scheme not in ("http", "https"):
        raise ImageBuildError(f"the index {root} lists {source.filename} at {echo(_redacted(file.url))}", step=_STEP)
    if file.sha256 is not None and file.sha256 != source.sha256:
        raise ImageBuildError(
            f"the index {root} lists {source.filename} with sha256 {file.sha256}, not the pinned {source.sha256}",
            step=_STEP,
        )
    if file.size is not None and file.size > max_bytes:
        raise _too_large(source.filename, max_bytes)
    return file


def _release_sdist(filename: str, source: SdistSource) -> bool:
    """Whether `filename` is an sdist of the source's project at its version."""
    try:
        name, version = parse_sdist_filename(filename)
        return name == canonicalize_name(source.package) and version == Version(source.version)
    except (InvalidSdistFilename, InvalidVersion):
        return False


def _json_files(body: bytes, page: httpx.URL) -> list[IndexFile]:
    """A PEP 691 page's files."""
    try:
        data: Any = json.loads(body)
        files = data["files"]
        if not isinstance(files, list):
            raise TypeError("files is not a list")
        out = []
        for f in files:
            hashes = f.get("hashes") or {}
            size = f.get("size")
            out.append(
                IndexFile(
                    filename=str(f["filename"]),
                    url=page.join(str(f["url"])),
                    sha256=str(hashes["sha256"]).lower() if "sha256" in hashes else None,
                    size=size if isinstance(size, int) else None,
                )
            )
        return out
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        why = f"the index page {_redacted(page)} is not a PEP 691 project page: {echo(str(e))}"
        raise ImageBuildError(why, step=_STEP) from e


class _Links(HTMLParser):
    """The anchors of a PEP 503 page: (href, text)."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href, self._text = dict(attrs).get("href"), []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _html_files(body: bytes, page: httpx.URL) -> list[IndexFile]:
    """A PEP 503 page's files: the anchor's text is the file name, `#sha256=` on its URL the digest."""
    parser = _Links()
    parser.feed(body.decode("utf-8", errors="replace"))
    out = []
    for href, text in parser.links:
        url = page.join(href)
        digest = re.fullmatch(r"sha256=([0-9a-fA-F]{64})", url.fragment)
        name = text or url.path.rsplit("/", 1)[-1]
        out.append(IndexFile(name, url.copy_with(fragment=None), digest[1].lower() if digest else None, None))
    return out


def _version_of(filename: str) -> Version | None:
    try:
        if filename.endswith(".whl"):
            return parse_wheel_filename(filename)[1]
        return parse_sdist_filename(filename)[1]
    except (InvalidSdistFilename, InvalidWheelFilename, InvalidVersion):
        return None


def _missing(source: SdistSource, files: list[IndexFile], root: str) -> str:
    """Why the index has no `source.filename`: no such version, or that version without this file."""
    try:
        wanted: Version | str = Version(source.version)
    except InvalidVersion:
        wanted = source.version
    same = [f.filename for f in files if _version_of(f.filename) == wanted]
    if same:
        return (
            f"the index {root} has no file {source.filename} for {source.package} {source.version} "
            f"(it has {', '.join(same[:8])}{', ...' if len(same) > 8 else ''}); the dataset must pin an sdist's name"
        )
    versions = sorted({v for f in files if (v := _version_of(f.filename)) is not None}, reverse=True)
    has = ", ".join(str(v) for v in versions[:8]) + (", ..." if len(versions) > 8 else "")
    return f"the index {root} has no version {source.version} of {source.package} (it has {has or 'none'})"


def _too_large(what: str, max_bytes: int) -> ImageBuildError:
    return ImageBuildError(f"{what} is over {max_bytes} bytes, the cap on a source archive", step=_STEP)


def _until(chunks: Iterable[bytes], deadline: float) -> Iterator[bytes]:
    """`chunks`, ended by an error once the fetch's deadline passes (each read has its own, shorter timeout)."""
    for chunk in chunks:
        if time.monotonic() > deadline:
            raise ImageBuildError("the fetch ran past its time limit: the index or the network is too slow", step=_STEP)
        yield chunk


@contextlib.contextmanager
def _staging(dest: Path) -> Iterator[Path]:
    """A fresh file next to `dest` (so a rename puts it in place), removed unless it was moved there."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".fetch-")
    os.close(fd)
    try:
        yield Path(tmp)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _write(chunks: Iterable[bytes], to: Path, max_bytes: int) -> str | None:
    """Write `chunks` to `to`: their sha256, or None as soon as they pass `max_bytes`."""
    h = hashlib.sha256()
    size = 0
    with to.open("wb") as f:
        for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:
                return None
            h.update(chunk)
            f.write(chunk)
    return h.hexdigest()


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


@contextlib.contextmanager
def open_archive(source: ArchiveSource, max_bytes: int = MAX_SOURCE_BYTES) -> Iterator[tuple[BinaryIO, int]]:
    """The archive at `source.path`, opened for reading, and its size; InvalidRequestError unless it is (or links
    to) a regular file of 1 to `max_bytes` bytes. Links are resolved first (the Hugging Face hub's and DVC's caches
    hand out links to their blobs), and what they lead to is checked as the path itself would be."""
    path = os.path.realpath(source.path)
    where = f"source archive {source.path}" + ("" if path == os.path.abspath(source.path) else f" (a link to {path})")
    # lstat before open: opening a device can act (a watchdog arms, a tape rewinds) and opening a FIFO waits
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        raise InvalidRequestError(f"{where} does not exist") from None
    except OSError as e:
        raise InvalidRequestError(f"{where} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(before.st_mode):
        kind = _KINDS.get(stat.S_IFMT(before.st_mode), "not a file")
        raise InvalidRequestError(f"{where} is not a regular file ({kind}); name a .tar.gz, .tar or .zip file")
    _check_size(where, before.st_size, max_bytes)
    # O_NOFOLLOW and O_NONBLOCK: whatever was swapped in since the lstat is neither followed nor waited on
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        why = "became a symbolic link" if e.errno == errno.ELOOP else f"cannot be read: {e.strerror}"
        raise InvalidRequestError(f"{where} {why}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise InvalidRequestError(f"{where} was replaced while it was opened")
        _check_size(where, st.st_size, max_bytes)
        yield f, st.st_size


def _check_size(where: str, size: int, max_bytes: int) -> None:
    if size == 0:  # kernel files (/proc, some of /sys) say 0 and may block on read
        raise InvalidRequestError(f"{where} is empty")
    if size > max_bytes:
        raise InvalidRequestError(f"{where} is {size} bytes, over the cap of {max_bytes}")


def copy_archive(source: ArchiveSource, f: BinaryIO, size: int, dest: Path) -> None:
    """Copy the `size` bytes of an opened archive to `dest`, which it reaches only with the pinned sha256."""

    def chunks() -> Iterator[bytes]:
        left = size + 1  # one byte more than fstat said: a file that grew is refused, not cut
        while left > 0 and (chunk := f.read(min(_CHUNK, left))):
            left -= len(chunk)
            yield chunk

    with _staging(dest) as tmp:
        digest = _write(chunks(), tmp, size)
        if digest is None:
            raise InvalidRequestError(f"source archive {source.path} grew while it was read")
        if digest != source.sha256:
            # the file's own digest is not quoted: a dataset may name any host file, and must not learn its digest
            raise InvalidRequestError(f"source archive {source.path} does not match its sha256 {source.sha256}")
        os.replace(tmp, dest)
