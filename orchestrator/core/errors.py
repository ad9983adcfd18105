"""envfleet's one exception tree. Every error derives from EnvfleetError and from one of the bases below, which the
gRPC edge maps to a status code (orchestrator/server/errors.py) and the client maps back:

- InvalidRequestError -> INVALID_ARGUMENT, NotFoundError -> NOT_FOUND, AlreadyExistsError -> ALREADY_EXISTS,
  FailedPreconditionError -> FAILED_PRECONDITION, QuotaExceededError -> RESOURCE_EXHAUSTED (a BusyError's with
  google.rpc.RetryInfo: it may succeed later),
  UnauthenticatedError -> UNAUTHENTICATED, PermissionDeniedError -> PERMISSION_DENIED,
  SandboxError -> UNAVAILABLE (infrastructure: a rollout that meets one is INFRA_ERROR and retried, never scored),
  SandboxFileError -> the caller's problem inside a sandbox (NOT_FOUND, PERMISSION_DENIED, FAILED_PRECONDITION).
- PolicyError and EnvironmentBroken classify rollouts (POLICY_ERROR, ENV_ERROR); they never reach a caller as such.

Leaves also inherit a builtin where one fits (TimeoutError, LookupError...), so plain `except` clauses work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# trailing metadata the API puts on every status it answers itself (server/errors.py): a client tells the server's own
# message from gRPC's transport failures, whose details name the client's insides (a socket path, an address)
SERVER_STATUS_KEY = "envfleet-status"


class EnvfleetError(Exception):
    """Root of every envfleet error."""


class InvalidRequestError(EnvfleetError, ValueError):
    """A request or spec is malformed; the message says which field and why."""


class SandboxError(EnvfleetError):
    """The sandbox infrastructure failed (engine, container or envd); not the task's fault."""


class SandboxCreateError(SandboxError):
    """A sandbox could not be created or never became ready."""


class LimitNotAppliedError(SandboxCreateError):
    """The engine could not apply a requested limit, so the create failed closed."""


class SandboxStartTimeoutError(SandboxCreateError, TimeoutError):
    """envd did not answer its health check before the startup deadline."""


class SandboxWaitTimeoutError(SandboxError, TimeoutError):
    """A rollout's time ran out before it had its image and sandbox (a congested fleet, a slow engine): the
    fleet's fault, retried, never the episode's TIMEOUT."""


class SandboxDiedError(SandboxError):
    """The sandbox's container stopped underneath us (killed from outside, OOM, engine restart)."""


class SandboxUnavailableError(SandboxError, ConnectionError):
    """envd did not answer, though the container may still be running."""


class EngineError(SandboxError):
    """The container engine failed a call (a 5xx answer, no answer): the fleet's fault, never the environment's."""


class SandboxFileError(EnvfleetError, OSError):
    """A file operation inside the sandbox failed (missing path, symlink refused, not a directory...)."""


class SandboxFileNotFoundError(SandboxFileError, FileNotFoundError):
    """The path does not exist inside the sandbox."""


class SandboxPermissionError(SandboxFileError, PermissionError):
    """The path may not be used: a symbolic link, or not permitted for the sandbox user."""


class NotFoundError(EnvfleetError, LookupError):
    """No such session or sandbox, or not the caller's (another tenant's work is reported as missing)."""


class AlreadyExistsError(EnvfleetError):
    """The name is taken: e.g. name@version registered with a different spec."""


class FailedPreconditionError(EnvfleetError):
    """The request is well-formed but the state does not allow it (an ended session, a spec that does not work)."""


class QuotaExceededError(EnvfleetError):
    """A per-tenant limit or a size limit was reached. As it is, the request fails again (a sandbox over the caps, a
    job of too many rollouts): a BusyError is one that can succeed later."""


class BusyError(QuotaExceededError):
    """A limit that frees up as other work ends: the host is full, or the tenant holds as many sessions, sandboxes
    or unfinished jobs as its cap allows. RESOURCE_EXHAUSTED with google.rpc.RetryInfo (in grpc-status-details-bin,
    readable by any gRPC client): asked again after `retry_after_s` or later, the call may succeed. The adapters'
    Reset waits so (orchestrator/client/busy.py); a status without RetryInfo is not worth a retry."""

    retry_after_s = 1.0


class UnauthenticatedError(EnvfleetError, PermissionError):
    """No valid credentials: a missing, unknown or expired bearer token."""


class PermissionDeniedError(EnvfleetError, PermissionError):
    """The caller is known but may not do this (e.g. re-register another tenant's environment)."""


class ConfigError(EnvfleetError, ValueError):
    """The server's own configuration is unsafe or broken (refused at start, never at a call)."""


class ImageBuildError(FailedPreconditionError, RuntimeError):
    """An image could not be built; the message names the failing step and ends with the log's tail."""

    def __init__(self, message: str, *, log_path: Path | None = None, step: str | None = None) -> None:
        super().__init__(message)
        self.log_path = log_path
        self.step = step


class ImageNotOnHostError(ImageBuildError):
    """An image a build reads is not on this host, or the engine cannot say (builds never pull). At registration the
    spec's problem; at a rollout, this host's (a Ray node without the base image the control plane's host has):
    INFRA_ERROR, never the environment's ENV_ERROR."""


class BuildRoomError(ImageBuildError):
    """A build of untrusted content would leave the engine's disk under the floor kept for sandboxes, with the
    tenants' images a collection may remove gone. This host's state, not the environment's: at a rollout (an image
    removed under disk pressure, built again) INFRA_ERROR, never the environment's ENV_ERROR."""


class PolicyError(EnvfleetError):
    """The policy server could not produce a completion; the rollout is POLICY_ERROR, never scored."""


class PolicyHTTPError(PolicyError):
    """The server answered with an HTTP error status (after the retries, for 429 and 5xx)."""

    def __init__(self, message: str, status: int, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.status, self.body))


class PolicyTimeoutError(PolicyError, TimeoutError):
    """The server did not answer within the endpoint's request timeout (on every attempt)."""


class PolicyConnectionError(PolicyError, ConnectionError):
    """The server could not be reached, or dropped the connection (on every attempt)."""


class PolicyResponseError(PolicyError, ValueError):
    """The server answered 2xx with a body that is not a chat completion."""


class GenerationAborted(PolicyError):
    """The server answered 2xx, but its finish_reason says it did not finish the generation ("abort", "error"):
    what it sent is partial. The client asks again, as after a 5xx; when the retries run out it is POLICY_ERROR.
    `down`: the server aborted it ("abort", as vLLM and SGLang do for a weight sync), so it is waited out as a server
    that is down is (PolicyEndpoint.outage_wait_s)."""

    def __init__(self, message: str, *, down: bool = False) -> None:
        super().__init__(message)
        self.down = down


class PolicyTokenError(PolicyResponseError):
    """The server's token ids or logprobs are not exact values a rollout can carry: an id that is no int in the
    wire's int32 range, a logprob that is not a finite float <= 0 (within float32), lists of unequal length. The
    message names the first bad value and its index; ids are never clamped or wrapped to fit."""


class JobNotFoundError(NotFoundError):
    """No job with that id."""


class JobFinishedError(FailedPreconditionError):
    """The job is completed or cancelled, so the request cannot apply."""


class CapacityError(QuotaExceededError):
    """The request can never fit this host's capacity (RESOURCE_EXHAUSTED)."""


class ArchiveTooLargeError(QuotaExceededError):
    """An archive (a download, a snapshot) grew past the cap it was read under; reading it stopped there."""


class EnvironmentNotFoundError(NotFoundError):
    """No environment of that name (or version); the message suggests the closest names."""


class InvalidEnvironmentError(InvalidRequestError):
    """A registration that fails validation."""


class EnvironmentBroken(EnvfleetError):
    """The environment's own code failed (setup, scoring, image): ENV_ERROR, not retried."""


class ContextFull(EnvfleetError):
    """A policy's episode context (JobSpec.max_model_len) has no room for another sampled token.

    Not a failure: the agent loop ends the episode there, TRUNCATED, with its tokens as far as they went."""


class GenerationTooLong(ContextFull):
    """A streamed answer passed the response cap carrying more tokens than an episode keeps (rollout/step.py's
    EPISODE_BYTES): the policy's own length, so the episode ends there, TRUNCATED without the turn, at any turn (a
    full context at the first turn is the job's, this never). Not a PolicyError: masked, a policy that rambles past
    the cap would never be scored for it."""


class EpisodeFailedError(EnvfleetError, RuntimeError):
    """An episode a trainer drove (a session) ended without a reward to learn from: INFRA_ERROR, ENV_ERROR, TIMEOUT
    or POLICY_ERROR. The sample must be masked, never scored 0."""

    def __init__(self, status: str, kind: str, message: str) -> None:
        super().__init__(f"episode ended with {status}: {kind}: {message}")
        self.status = status
        self.kind = kind
