"""Policy configuration: where the trainer's policy is served and how to sample from it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Sampling(BaseModel):
    """Sampling parameters of one completion request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(1024, ge=1, le=1_000_000)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)


REPLAY_URL = "replay://reference"


class PolicyEndpoint(BaseModel):
    """Where the policy is served: an OpenAI-compatible base URL (usually ending in /v1) and how to call it.

    `replay://reference` is no server: each task's reference solution is replayed in process, instantly. It is for
    measuring and simulating the fleet itself; its rollouts carry no tokens.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str
    model: str = "policy"
    api_key: str = Field("", repr=False)
    version: str = "0"
    request_timeout_s: float = Field(120.0, gt=0, le=3600)
    max_retries: int = Field(3, ge=0, le=20)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if v == REPLAY_URL:
            return v
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https:// (or be {REPLAY_URL}), got {v!r}")
        return v.rstrip("/")
