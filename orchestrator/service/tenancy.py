"""Tenants and their bearer tokens: a token file maps each token to a tenant name (and an optional expiry).

    # tokens.yaml: token -> tenant, or token -> {tenant, expires_at}
    tokens:
      "f3f0c5...": team-a
      "9b1e27...": {tenant: team-b, expires_at: "2030-01-01T00:00:00Z"}

Tokens are kept only as sha256 digests, so a lookup never compares secrets character by character. The file is
re-read when it changes, so tokens can be rotated without a restart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.core.errors import ConfigError, UnauthenticatedError

log = logging.getLogger(__name__)

# The one tenant of a server without a token file (a local, loopback-only quick start).
LOCAL_TENANT = "local"
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
MIN_TOKEN_CHARS = 16
RELOAD_CHECK_S = 2.0


class TokenEntry(BaseModel):
    """Who a token belongs to and until when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field(pattern=TENANT_PATTERN)
    expires_at: datetime | None = None


class TokenFile(BaseModel):
    """The token file's schema."""

    model_config = ConfigDict(extra="forbid")

    tokens: dict[str, TokenEntry | str] = Field(min_length=1)


@dataclass(frozen=True)
class _Grant:
    tenant: str
    expires_at: float | None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class TokenTable:
    """Token digests -> tenants. Build with `TokenTable.load(path)` or from a mapping."""

    def __init__(self, entries: Mapping[str, TokenEntry]) -> None:
        self._grants = {
            _digest(token): _Grant(e.tenant, e.expires_at.timestamp() if e.expires_at else None)
            for token, e in entries.items()
        }

    @classmethod
    def parse(cls, text: str, source: str = "token file") -> TokenTable:
        """A table from the YAML (or JSON) text of a token file; ConfigError says what is wrong."""
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        try:
            parsed = TokenFile.model_validate(raw)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'file'}: {err['msg']}" for err in e.errors())
            raise ConfigError(f"{source}: {problems}") from None
        entries: dict[str, TokenEntry] = {}
        for token, value in parsed.tokens.items():
            if len(token) < MIN_TOKEN_CHARS:
                raise ConfigError(
                    f"{source}: a token is shorter than {MIN_TOKEN_CHARS} characters; use long random ones"
                )
            try:
                entries[token] = TokenEntry(tenant=value) if isinstance(value, str) else value
            except ValidationError:
                raise ConfigError(f"{source}: tenant name {value!r} must match {TENANT_PATTERN}") from None
        return cls(entries)

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        """Read and parse a token file."""
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read token file {path}: {e.strerror}") from None
        return cls.parse(text, str(path))

    def tenant_of(self, token: str, now: float | None = None) -> str:
        """The tenant a token belongs to; UnauthenticatedError for an unknown or expired token."""
        grant = self._grants.get(_digest(token))
        if grant is None:
            raise UnauthenticatedError("invalid bearer token")
        if grant.expires_at is not None and (now if now is not None else time.time()) >= grant.expires_at:
            when = datetime.fromtimestamp(grant.expires_at).astimezone().isoformat(timespec="seconds")
            raise UnauthenticatedError(f"bearer token expired at {when}")
        return grant.tenant

    def __len__(self) -> int:
        return len(self._grants)


class TokenSource:
    """A token file, re-read when its modification time changes (checked at most every RELOAD_CHECK_S).

    A broken edit is logged and the previous table stays in force, so a typo never locks every tenant out.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._table = TokenTable.load(path)
        self._mtime = self._stat()
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _stat(self) -> int:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return -1

    def table(self) -> TokenTable:
        """The current table."""
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return self._table
        with self._lock:
            self._checked = now
            mtime = self._stat()
            if mtime != self._mtime:
                self._mtime = mtime
                try:
                    self._table = TokenTable.load(self.path)
                    log.info("reloaded token file %s (%d tokens)", self.path, len(self._table))
                except ConfigError as e:
                    log.error("token file changed but is broken; keeping the previous tokens: %s", e)
        return self._table
