"""The OpenEnv facade's settings. Imports nothing of OpenEnv: `OrchestratorConfig` holds one without the extra."""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.core.errors import ConfigError
from orchestrator.core.net import is_loopback

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20


class OpenEnvConfig(BaseModel):
    """Where the facade listens and what it lets in."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="plain HTTP: loopback unless the operator passes insecure")
    port: int = Field(..., ge=0, le=65535, description="0 picks a free port")
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES, ge=4096, le=64 << 20, description="largest websocket frame a client may send"
    )
    max_connections: int = Field(1024, ge=1, le=100_000, description="open websockets, all callers together")
    max_connections_per_caller: int = Field(
        64, ge=1, le=100_000, description="open websockets of one bearer token (or of the local tenant)"
    )
    call_timeout_s: float = Field(1800.0, gt=0, le=24 * 3600, description="deadline of one reset or step")
    idle_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=24 * 3600,
        description="a websocket whose client sends no frame for this long is closed with its session (its pings "
        "kept it open for good, holding a slot of max_connections); a reset or step under way does not count",
    )


def check_facade_host(host: str, insecure: bool) -> None:
    """The facade speaks plain HTTP: off loopback, bearer tokens would cross the network in clear."""
    if is_loopback(host):
        return
    what = "the OpenEnv facade speaks plain HTTP, so bearer tokens would cross the network in clear"
    if not insecure:
        raise ConfigError(
            f"refusing to serve OpenEnv on {host!r}: {what}. Listen on 127.0.0.1 (put a TLS proxy in front) "
            "or pass --insecure if you really mean it"
        )
    log.warning("INSECURE: serving OpenEnv on %s: %s; never do this outside a trusted network", host, what)
