"""What a build of untrusted content may write to the host's disk (BuildLimits.disk_mb), held while it runs.

The engine's classic builder has no disk quota: a Dockerfile step can write until the host's disk is full, which
stops every sandbox on it. The build's output names each step's container (" ---> Running in <id>") and each layer
it commits (" ---> <id>"). The guard adds up the committed layers' sizes, and a thread polls the running step's
container for what it has written so far. Past the limit it kills that container and every later step's, so the
engine ends the build at the next step that runs, and the build is refused naming the limit (one that ends anyway
is refused all the same). A step that writes faster than a poll overshoots by what it writes in one (DISK_POLL_S;
longer for a step of many files, which the engine walks to size them).

A failed build leaves its committed layers on the engine as untagged images; `forget` removes them, so that
failing builds cannot pile up layers either.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from types import TracebackType

import docker
import docker.errors
import requests

DISK_POLL_S = 0.5
POLL_SHARE = 0.1
CANCEL_WAIT_S = 10.0  # for the engine to stop a cancelled build's step and remove its container
_RUNNING = re.compile(r"^ ---> Running in ([0-9a-f]{12,64})$")
_LAYER = re.compile(r"^ ---> ([0-9a-f]{12,64})$")
_CACHED = " ---> Using cache"
_FROM = re.compile(r"^Step \d+/\d+ : FROM ", re.IGNORECASE)


class DiskGuard:
    """Holds one build to `limit_mb` of layers; feed it every line the build prints (`saw`), then read `over`."""

    def __init__(self, client: docker.DockerClient, limit_mb: int) -> None:
        self._client = client
        self.limit_mb = limit_mb
        self.committed = 0  # bytes of the layers this build's steps committed so far
        self.layers: list[str] = []  # the images its steps committed, oldest first (not a FROM's, not a cached one)
        self.over: str | None = None  # why the build was stopped, once it wrote past the limit
        self._step: str | None = None  # the running step's container
        self._after_from = False
        self._cached = False  # the next layer is an earlier build's, taken from the cache
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="build disk guard", daemon=True)

    def __enter__(self) -> DiskGuard:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        self._thread.join()

    def saw(self, line: str) -> None:
        """One line of the build's output."""
        if _FROM.match(line):
            self._after_from = True
        elif line == _CACHED:
            self._cached = True
        elif m := _RUNNING.match(line):
            with self._lock:
                self._step = m[1]
            if self.over is not None:
                self._kill(m[1])
        elif m := _LAYER.match(line):
            with self._lock:
                self._step = None
            if self._after_from:  # the base image the stage starts from: not written by this build
                self._after_from = False
                return
            if self._cached:  # part of the image, so counted, but another image's too: never removed
                self._cached = False
            else:
                self.layers.append(m[1])
            self.committed += self._layer_size(m[1])
            self._check(0)

    def forget(self, cancelled: bool) -> None:
        """Remove the layers a failed build committed (untagged images; one that is another image's parent stays).
        A `cancelled` build may still be running the step after its last layer: its container is waited for
        (CANCEL_WAIT_S at most), as a layer in use cannot be removed."""
        if not self.layers:
            return
        deadline = time.monotonic() + (CANCEL_WAIT_S if cancelled else 0.0)
        while time.monotonic() < deadline and self._in_use(self.layers[-1]):
            time.sleep(0.2)
        for image in reversed(self.layers):
            with contextlib.suppress(docker.errors.APIError, requests.exceptions.RequestException):
                self._client.api.remove_image(image, force=False, noprune=False)

    def _in_use(self, image: str) -> bool:
        try:
            return bool(self._client.api.containers(all=True, filters={"ancestor": image}, quiet=True))
        except (docker.errors.APIError, requests.exceptions.RequestException):
            return False

    def _layer_size(self, image: str) -> int:
        try:
            history = self._client.api.history(image)
        except docker.errors.APIError:
            return 0  # gone already (a parallel build's cleanup): nothing of this build's to count
        return int(history[0].get("Size") or 0) if history else 0

    def _check(self, writing: int) -> bool:
        total = self.committed + writing
        if total <= self.limit_mb << 20 or self.over is not None:
            return self.over is not None
        self.over = (
            f"the build wrote {total >> 20} MB, over its disk limit of {self.limit_mb} MB; the build was refused "
            "and its layers removed (keep what the image needs, or clean up within the step that writes it)"
        )
        return True

    def _poll(self) -> None:
        wait = DISK_POLL_S
        while not self._done.wait(wait):
            with self._lock:
                step = self._step
            if step is None:
                continue
            if self.over is None:
                started = time.monotonic()
                try:
                    found = self._client.api.containers(all=True, filters={"id": step}, size=True)
                except (docker.errors.APIError, requests.exceptions.RequestException):  # the build's reader sees it
                    continue
                finally:
                    # the engine walks the step's files to size them: a step of many files is polled less often,
                    # so that the walks take at most POLL_SHARE of the engine's time
                    wait = max(DISK_POLL_S, (time.monotonic() - started) / POLL_SHARE)
                if not found or not self._check(int(found[0].get("SizeRw") or 0)):
                    continue
            self._kill(step)

    def _kill(self, container: str) -> None:
        """Fail the step (the builder removes its container: forcerm); the engine ends the build at it."""
        with contextlib.suppress(docker.errors.APIError, requests.exceptions.RequestException):
            self._client.api.kill(container)
