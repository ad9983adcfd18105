"""What a build of untrusted content may write to the host's disk (BuildLimits.disk_mb), held while it runs.

The engine's classic builder has no disk quota: a Dockerfile step can write until the host's disk is full, which
stops every sandbox on it. The build's output names each step's container (" ---> Running in <id>") and each layer
it commits (" ---> <id>"). The guard adds up the committed layers' sizes, and a thread polls the running step's
container for what it has written so far. Past the limit it kills that container and every later step's, so the
engine ends the build at the next step that runs, and the build is refused naming the limit (one that ends anyway
is refused all the same). A step that writes faster than a poll overshoots by what it writes in one (DISK_POLL_S;
longer for a step of many files, which the engine walks to size them).

The output is the tenant's too: a RUN step prints what it likes, lines that look like the engine's among them. So a
line only names what the guard then checks on the engine. A layer counts as this build's when its parent is an
image the build has reached (the Dockerfile's FROM images, then each layer taken); one made after the build started
is its own (removed if it fails), an older one the cache's (kept). A step's container counts when it was made after
the build started, from an image the build has reached, and is no sandbox. Printed lines once stopped the guard
from watching a running step, left a layer uncounted, or named another image to remove.

A failed build leaves its committed layers on the engine as untagged images; `forget` removes them, so that
failing builds cannot pile up layers either.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import threading
import time
from collections.abc import Callable, Collection
from types import TracebackType
from typing import Any

import docker
import docker.errors
import requests

DISK_POLL_S = 0.5
POLL_SHARE = 0.1
CANCEL_WAIT_S = 10.0  # for the engine to stop a cancelled build's step and remove its container
_RUNNING = re.compile(r"^ ---> Running in ([0-9a-f]{12,64})$")
_LAYER = re.compile(r"^ ---> ([0-9a-f]{12,64})$")
SANDBOX_LABEL = "envfleet.managed"  # every sandbox carries it (backends/docker/sweeper.LABEL_MANAGED)
# lines that look like the engine's a build may print, each checked on the engine (a real build prints two a step);
# past it the build is stopped: a step's million such lines were a million calls to the engine every sandbox uses
MAX_CHECKS = 2_000


_STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?")


def _created(stamp: str) -> float:
    """The engine's RFC 3339 time (nanoseconds; Z, an offset, or none for UTC) as a Unix time; ValueError for
    another form."""
    m = _STAMP.fullmatch(stamp)
    if m is None:
        raise ValueError(f"not an RFC 3339 time: {stamp!r}")
    zone = "+00:00" if m[3] in (None, "Z") else m[3]
    return datetime.datetime.fromisoformat(m[1] + zone).timestamp() + float(f"0.{m[2] or 0}")


def _engine_now(client: docker.DockerClient) -> float:
    """The engine's own time (its SystemTime, RFC 3339 in its zone) as a Unix time: a build's containers and layers
    are stamped by it, and compared with this host's clock, an engine behind it (a remote one, a clock set back) made
    every step look older than the build, and the build's disk limit was never enforced. This host's clock when the
    engine does not say."""
    try:
        return _created(str(client.info().get("SystemTime", "")))
    except (docker.errors.DockerException, OSError, ValueError):
        return time.time()


class DiskGuard:
    """Holds one build to `limit_mb` of layers; feed it every line the build prints (`saw`), then read `over`.
    `bases`: the ids of the images the Dockerfile builds FROM."""

    def __init__(self, client: docker.DockerClient, limit_mb: int, bases: Collection[str] = ()) -> None:
        self._client = client
        self.limit_mb = limit_mb
        self.committed = 0  # bytes of the layers this build's steps committed so far
        self.layers: list[str] = []  # the images its steps committed, oldest first (not a FROM's, not a cached one)
        self.over: str | None = None  # why the build was stopped, once it wrote past the limit
        self._step: str | None = None  # the running step's container
        self._reached = set(bases)  # image ids the build has reached: its FROM images, then each layer taken
        self._checks = 0  # the lines it printed that look like the engine's, each checked on the engine
        self.cut = False  # past MAX_CHECKS: it watches no more, and the build is to be cancelled (build._run_build)
        self._started = _engine_now(client)  # the engine's clock, which stamps what the build makes
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
        """One line of the build's output: the engine's, or a step's that looks like it (checked on the engine)."""
        m = _RUNNING.match(line) or _LAYER.match(line)
        if m is None or self._has_reached(m[1]):
            return  # a FROM's image, or a layer taken already: nothing to check
        self._checks += 1
        if self._checks > MAX_CHECKS:
            self.cut = True
            if self.over is None:
                self.over = (
                    f"the build printed more than {MAX_CHECKS} lines that look like the builder's own (' ---> <id>'); "
                    "it was refused and its layers removed (send such output to a file, or to /dev/null)"
                )
                with self._lock:
                    step = self._step
                if step is not None:
                    self._kill(step)
            return
        if line.startswith(" ---> Running in "):
            container = self._inspect(self._client.api.inspect_container, m[1])
            if container is None or not self._is_step(container):
                return
            with self._lock:
                self._step = str(container["Id"])
            if self.over is not None:
                self._kill(self._step)
        else:
            image = self._inspect(self._client.api.inspect_image, m[1])
            if image is None or image["Id"] in self._reached or image.get("Parent") not in self._reached:
                return  # a FROM's (reached already), one printed again, or none of this build's
            self._reached.add(image["Id"])
            if _created(image["Created"]) >= self._started:  # committed by this build's step, which has ended
                with self._lock:
                    self._step = None
                self.layers.append(image["Id"])
            # else the cache's (an earlier build's): part of the image, so counted, but never removed
            self.committed += self._layer_size(image["Id"])
            self._check(0)

    def _has_reached(self, ref: str) -> bool:
        """Whether an id as the build prints it (12 hex or more) is one of an image the build has reached."""
        return any(i.removeprefix("sha256:").startswith(ref) for i in self._reached)

    def _is_step(self, container: dict[str, Any]) -> bool:
        """Whether a container is one of this build's steps: made since it started, from an image it reached, and
        no sandbox (a sandbox of the base image is made from an image every build reaches). A sandbox is labelled
        so when it is made; a step takes its labels from the image so far, so the label counts only where that
        image has none (a Dockerfile's own `LABEL $K=1`, K an ARG, hid every later step from the guard)."""
        image = container.get("Image")
        if image not in self._reached or _created(container["Created"]) < self._started:
            return False
        if SANDBOX_LABEL not in ((container.get("Config") or {}).get("Labels") or {}):
            return True
        made_from = self._inspect(self._client.api.inspect_image, str(image))
        return made_from is not None and SANDBOX_LABEL in ((made_from.get("Config") or {}).get("Labels") or {})

    @staticmethod
    def _inspect(call: Callable[[str], dict[str, Any]], ref: str) -> dict[str, Any] | None:
        try:
            return call(ref)
        except (docker.errors.APIError, requests.exceptions.RequestException):
            return None  # none of that id (a printed line), or gone already (a parallel build's cleanup)

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
