"""Environments that tenants upload as an archive, in a format a plug-in reads (the first: Harbor task directories).

The seam: an `ArchiveKind` (entry point group `envfleet.archive_kinds`, name = the kind) unpacks a tenant's archive
safely under `ArchiveLimits`, turns it into an Environment that builds its own image, and validates it on real
sandboxes. The orchestrator stores the archive per tenant, registers the environment privately, and ships the
archive to rollout workers, which load it with the same kind.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from orchestrator.core.environment import Environment
from orchestrator.core.sandbox import SandboxBackend

ENTRY_POINT_GROUP = "envfleet.archive_kinds"


@dataclass(frozen=True)
class ArchiveLimits:
    """What unpacking one archive may produce; each name is the `caps.archive.<name>` setting that set it."""

    members: int
    unpacked_bytes: int
    member_bytes: int


@dataclass
class TaskValidation:
    """One task's validation: its reference solution's reward, an empty solution's, and what went wrong."""

    task_id: str
    reference_reward: float | None = None
    empty_reward: float | None = None
    problems: list[str] = field(default_factory=list)


class ArchiveKind(abc.ABC):
    """A format of uploaded environment. Every method treats the archive as hostile input."""

    @abc.abstractmethod
    def load(self, archive: Path, dest: Path, name: str, version: str, limits: ArchiveLimits) -> Environment:
        """Unpack `archive` into the empty folder `dest` (nothing outside it, within `limits`) and return the
        environment it describes, `name@version`. Blocking: call it in a thread.

        InvalidRequestError for an unsafe or malformed archive (the message names the member, task or field),
        QuotaExceededError naming `caps.archive.<limit>` for one over a limit. The environment builds its own image
        (orchestrator.images.resolver.BuildsOwnImage) under the tenant build limits."""

    @abc.abstractmethod
    async def validate(self, env: Environment, backend: SandboxBackend, image: str) -> Sequence[TaskValidation]:
        """Check every task of an environment `load` made on sandboxes of `image` (already built); every step is
        time-bounded. A task with problems fails the registration."""

    # How this kind reads and grades an archive. A registration records the rules it was validated under; one of
    # other rules (older code's) is loaded as not validated (`validated` is not applied), since its checks proved
    # nothing about how its tasks run now. Change it whenever `load` or the grading changes what a task does.
    rules: ClassVar[str] = ""

    def validated(self, env: Environment) -> Environment:
        """`env` (made by `load`) as a registered archive's, whose every task passed `validate`: in the control plane
        once registered or reloaded, and on each worker it is shipped to. Nothing changes by default; a kind whose
        grader tells a broken task from an agent's doing by that validation uses it (environments/harbor)."""
        return env
