"""The orchestrator's exception tree.

SandboxError and its leaves are infrastructure failures: a rollout that meets one is INFRA_ERROR and retried, never
scored. SandboxFileError and InvalidRequestError are the caller's or the task's problem.
"""

from __future__ import annotations


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


class SandboxDiedError(SandboxError):
    """The sandbox's container stopped underneath us (killed from outside, OOM, engine restart)."""


class SandboxUnavailableError(SandboxError, ConnectionError):
    """envd did not answer, though the container may still be running."""


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
    """A per-tenant limit or a size limit was reached."""


class UnauthenticatedError(EnvfleetError, PermissionError):
    """No valid credentials: a missing, unknown or expired bearer token."""


class PermissionDeniedError(EnvfleetError, PermissionError):
    """The caller is known but may not do this (e.g. re-register another tenant's environment)."""


class ConfigError(EnvfleetError, ValueError):
    """The server's own configuration is unsafe or broken (refused at start, never at a call)."""
