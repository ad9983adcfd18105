"""Uploaded environment archives on the control plane: the kinds plug-ins provide, the per-tenant store under the
data dir, and the catalog that tells the worker hub which registered environments come from an archive.

    <data_dir>/environments/archives/<tenant>/<name>@<version>.json   StoredArchive (owner, kind, digest, ...)
    <data_dir>/environments/archives/<tenant>/<name>@<version>.tar    the archive, as the tenant sent it
    <data_dir>/environments/archives/<tenant>/<name>@<version>/       its unpacked tree (remade at every start)

A tenant name matches TENANT_PATTERN and a name@version the registry's patterns, so no path is tenant-made beyond
those checked names.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.core.archives import ENTRY_POINT_GROUP, ArchiveKind
from orchestrator.core.echo import echo, error_text
from orchestrator.core.environment import Environment
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.files import sweep_temporaries, write_atomically
from orchestrator.service.declarative.spec import NAME_PATTERN, VERSION_PATTERN
from orchestrator.service.tenancy import TENANT_PATTERN

log = logging.getLogger(__name__)

_KIND = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def load_kinds(group: str = ENTRY_POINT_GROUP) -> dict[str, ArchiveKind]:
    """The archive kinds installed plug-ins declare, by name; a broken one is logged and left out."""
    kinds: dict[str, ArchiveKind] = {}
    for ep in importlib.metadata.entry_points(group=group):
        try:
            kind = ep.load()()
        except Exception:
            log.exception("archive kind %s (%s) failed to load", ep.name, ep.value)
            continue
        if not isinstance(kind, ArchiveKind):
            log.error("archive kind %s (%s) is not an ArchiveKind; left out", ep.name, ep.value)
            continue
        kinds[ep.name] = kind
    return kinds


class ArchiveUpload(BaseModel):
    """An archive as a tenant sent it (EnvironmentArchive, converted at the edge)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = Field(pattern=_KIND.pattern)
    name: str = Field(pattern=NAME_PATTERN)
    version: str = Field("1", pattern=VERSION_PATTERN)
    visibility: Literal["private", "public"] = "private"
    data: bytes = Field(repr=False)

    @property
    def digest(self) -> str:
        """sha256 of the archive's bytes."""
        return hashlib.sha256(self.data).hexdigest()

    def ref(self) -> str:
        """`name@version`."""
        return f"{self.name}@{self.version}"


def parse_upload(kind: str, name: str, version: str, visibility: str, data: bytes) -> ArchiveUpload:
    """A checked upload; InvalidRequestError names every bad field."""
    try:
        return ArchiveUpload(
            kind=kind, name=name, version=version or "1", visibility=visibility or "private", data=data
        )
    except ValidationError as e:
        problems = [f"{'.'.join(map(str, err['loc']))}: {err['msg']} (got {echo(err['input'])})" for err in e.errors()]
        raise InvalidRequestError("invalid environment archive: " + "; ".join(problems)) from None


class StoredArchive(BaseModel):
    """A registered archive's record."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    owner: str = Field(pattern=TENANT_PATTERN)
    registered_at: float
    kind: str
    name: str = Field(pattern=NAME_PATTERN)
    version: str = Field(pattern=VERSION_PATTERN)
    visibility: Literal["private", "public"] = "private"
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    rules: str = Field("", max_length=64)  # its kind's rules it was validated under (ArchiveKind.rules)

    def ref(self) -> str:
        """`name@version`."""
        return f"{self.name}@{self.version}"


class ArchiveStore:
    """Archives per tenant under one folder (blocking: call it in a thread)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _folder(self, tenant: str) -> Path:
        if not re.match(TENANT_PATTERN, tenant):  # a tenant name is checked where tokens are read; never trusted here
            raise InvalidRequestError(f"tenant {echo(tenant)} cannot own archives")
        return self.root / tenant

    def archive_path(self, record: StoredArchive) -> Path:
        """Where a record's archive is."""
        return self._folder(record.owner) / f"{record.ref()}.tar"

    def tree(self, tenant: str, ref: str) -> Path:
        """An empty folder for the unpacked tree of `ref` (what was there is removed)."""
        path = self._folder(tenant) / ref
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def staging(self, tenant: str) -> Path:
        """A fresh private folder for an upload being checked; the caller removes it."""
        folder = self._folder(tenant)
        folder.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=folder, prefix=".staging-"))

    def sweep(self) -> int:
        """Remove what a killed process left: staging folders, temporary copies, and an archive or unpacked tree
        with no record beside it (a registration killed before its record was written: the call failed, and the
        tree counted against the tenant's cap for good). Returns how many; call it before any registration."""
        left = 0
        for folder in self.root.iterdir() if self.root.is_dir() else []:
            if not folder.is_dir() or folder.is_symlink():
                continue
            left += sweep_temporaries(folder)
            for path in folder.iterdir():
                tree = path.is_dir() and not path.is_symlink()
                # an archive is <ref>.tar and its tree <ref>/, beside their record <ref>.json
                ref = path.name if tree else path.name.removesuffix(".tar") if path.suffix == ".tar" else ""
                if path.name.startswith(".staging-") or (
                    ref and not ref.startswith(".") and not (folder / f"{ref}.json").exists()
                ):
                    if tree:
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
                    left += 1
        return left

    def held_bytes(self, tenant: str) -> int:
        """The bytes of the archives `tenant` keeps registered: as sent, and their unpacked trees (a small archive
        may unpack to many times its size, and every tree stays on disk)."""
        folder = self._folder(tenant)
        if not folder.is_dir():
            return 0
        held = 0
        for path in folder.iterdir():
            if path.suffix == ".tar" and path.is_file():
                held += path.stat().st_size
            elif path.is_dir() and not path.is_symlink() and not path.name.startswith(".staging-"):
                held += sum(os.lstat(Path(top) / f).st_size for top, _, files in os.walk(path) for f in files)
        return held

    def save(self, record: StoredArchive, data: bytes) -> None:
        """The archive first, then its record (a record always has its archive)."""
        folder = self._folder(record.owner)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(self.archive_path(record), data)
        write_atomically(folder / f"{record.ref()}.json", record.model_dump_json(indent=1).encode())

    def delete(self, record: StoredArchive) -> None:
        """Forget a record, its archive and its tree."""
        folder = self._folder(record.owner)
        for path in (folder / f"{record.ref()}.json", self.archive_path(record)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        shutil.rmtree(folder / record.ref(), ignore_errors=True)

    def load_all(self) -> list[StoredArchive]:
        """Every readable record (with its archive), oldest first; unreadable ones are logged and skipped, and their
        names' owners, where the record says them, are kept in `unreadable` (name -> owner)."""
        records = []
        self.unreadable: dict[str, str] = {}
        for path in sorted(self.root.glob("*/[!.]*.json")) if self.root.is_dir() else []:
            try:
                record = StoredArchive.model_validate_json(path.read_bytes())
            except (OSError, ValidationError) as e:
                log.error("skipping unreadable environment archive record %s: %s", path, error_text(e))
                claim = claim_in(path, ("name",))
                if claim is not None:
                    self.unreadable.setdefault(*claim)
                continue
            if path.parent.name != record.owner or not self.archive_path(record).is_file():
                log.error("skipping environment archive record %s: its archive or owner does not match", path)
                continue
            records.append(record)
        return sorted(records, key=lambda r: r.registered_at)


@dataclass(frozen=True)
class Shipment:
    """What a worker needs to load an archive environment: its kind, identity and where its bytes are."""

    kind: str
    name: str
    version: str
    digest: str
    path: Path
    rules: str  # its kind's rules it was validated under: a worker whose plug-in has other ones loads it unvalidated


class ArchiveCatalog:
    """The registered environments that come from an archive (the worker hub ships them to workers)."""

    def __init__(self) -> None:
        self._by_ref: dict[str, tuple[Environment, Shipment]] = {}

    def add(self, env: Environment, shipment: Shipment) -> None:
        """Record where `env` came from."""
        self._by_ref[env.ref()] = (env, shipment)

    def shipment(self, env: Environment) -> Shipment | None:
        """The archive `env` (this very instance) was loaded from; None for any other environment."""
        entry = self._by_ref.get(env.ref())
        return entry[1] if entry is not None and entry[0] is env else None


def claim_in(path: Path, name_at: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, owner) as a stored record that no longer loads says them (a check tightened since), if it does: its
    name stays its owner's. Skipped, the name was anyone's, and another tenant's registration replaced the file."""
    try:
        raw: Any = json.loads(path.read_bytes())
        owner = raw["owner"]
        for key in name_at:
            raw = raw[key]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return None
    return (raw, owner) if isinstance(raw, str) and isinstance(owner, str) else None
