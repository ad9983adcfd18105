"""Harbor task directories as an uploaded archive: `pack` on the client, `HarborKind` on the server and its workers
(entry point `envfleet.archive_kinds: harbor`).

The archive is a tar.gz with one folder per task at its top level, named by the task id. It is tenant input: it is
unpacked with the safe-archive code of environments/swe/snapshot.py (every member resolved against the tree being
built, links that leave it refused, members and sizes under `caps.archive.*`), then parsed by `load_task` (Dockerfile
checks, no network) and held to the limits of any tenant build and scoring command.
"""

from __future__ import annotations

import gzip
import io
import lzma
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from environments.harbor.env import HarborEnvironment, load_tasks, make_harbor_environment, mark_validated
from environments.harbor.task import HarborTaskError
from environments.harbor.validate import validate
from environments.swe.snapshot import ArchiveLimitError, SnapshotError, extract_archive
from environments.swe.snapshot import ArchiveLimits as ExtractLimits
from orchestrator.core.archives import ArchiveKind, ArchiveLimits, TaskValidation
from orchestrator.core.environment import Environment
from orchestrator.core.errors import ArchiveTooLargeError
from orchestrator.core.sandbox import SandboxBackend
from orchestrator.service.declarative.env import TENANT_BUILD

KIND = "harbor"
# an uploaded task's agent and verifier timeouts: at most what a declarative scoring command may take
MAX_TASK_TIMEOUT_S = 3600.0
# which caps.archive setting each extraction limit is
_CAP = {"members": "members", "total_bytes": "unpacked_bytes", "member_bytes": "member_bytes"}


def _reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """The same bytes for the same files, whoever packs them when: so a repeated registration is recognized."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    info.mode = 0o755 if info.isdir() or info.mode & 0o111 else 0o644
    return info


def pack(dirs: Sequence[Path]) -> bytes:
    """A tar.gz of the task directories, each under its task id (checked first, as a local import checks them)."""
    tasks = load_tasks([Path(d) for d in dirs])
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tf:
        for task_id, task in tasks.items():
            tf.add(task.path, arcname=task_id, filter=_reset)  # a folder's entries are added in sorted order
    return buf.getvalue()


def _unpack(archive: Path, dest: Path, limits: ArchiveLimits) -> list[Path]:
    try:
        extract_archive(
            archive,
            dest,
            strip=0,
            limits=ExtractLimits(
                members=limits.members, total_bytes=limits.unpacked_bytes, member_bytes=limits.member_bytes
            ),
        )
    except ArchiveLimitError as e:
        cap = _CAP.get(e.limit)
        raise ArchiveTooLargeError(f"the archive is refused: {e}" + (f" (caps.archive.{cap})" if cap else "")) from None
    except SnapshotError as e:
        raise HarborTaskError(f"the archive is refused: {e}") from None
    except (tarfile.TarError, zipfile.BadZipFile, lzma.LZMAError, EOFError, OSError) as e:
        raise HarborTaskError(f"the archive is not a readable tar(.gz) or zip: {e}") from None
    entries = sorted(dest.iterdir())
    stray = [p.name for p in entries if p.is_symlink() or not p.is_dir()]
    if stray:
        raise HarborTaskError(
            f"the archive's top level must hold only task folders (one per task, named by its id); found {stray[:5]}"
        )
    if not entries:
        raise HarborTaskError("the archive holds no task folders")
    return entries


def check_uploaded(env: HarborEnvironment) -> None:
    """What an uploaded task may ask for beyond a local import: timeouts within a tenant's build and scoring."""
    for t in env.harbor_tasks.values():
        for section, key, value, cap in (
            ("environment", "build_timeout_sec", t.build_timeout_s, TENANT_BUILD.timeout_s),
            ("agent", "timeout_sec", t.agent_timeout_s, MAX_TASK_TIMEOUT_S),
            ("verifier", "timeout_sec", t.verifier_timeout_s, MAX_TASK_TIMEOUT_S),
        ):
            if value > cap:
                raise HarborTaskError(
                    f"task {t.id}: [{section}] {key} = {value:g} is over {cap:g}, the most an uploaded task may take"
                )


class HarborKind(ArchiveKind):
    """Harbor / Terminal-Bench task directories, uploaded with `envfleet envs import-harbor --server`."""

    # 2: the workdir is the Dockerfile's, scripts run by their `#!` line, [agent] timeout_sec is the whole episode
    rules = "2"

    def load(self, archive: Path, dest: Path, name: str, version: str, limits: ArchiveLimits) -> Environment:
        """Unpack safely, parse every task, and refuse what a tenant may not ask for."""
        env = make_harbor_environment(name, _unpack(archive, dest, limits), version)
        check_uploaded(env)
        return env

    async def validate(self, env: Environment, backend: SandboxBackend, image: str) -> Sequence[TaskValidation]:
        """Each task's oracle (solution/solve.sh) must pass and an empty solution must fail, as a local import."""
        if not isinstance(env, HarborEnvironment):
            raise TypeError(f"{env.ref()} is not a Harbor environment")
        return [TaskValidation(c.task_id, c.oracle, c.empty, c.problems) for c in await validate(env, backend, image)]

    def validated(self, env: Environment) -> Environment:
        """A registered archive's tasks all passed: a verifier that fails after an agent's turn scores 0."""
        if not isinstance(env, HarborEnvironment):
            raise TypeError(f"{env.ref()} is not a Harbor environment")
        return mark_validated(env)
