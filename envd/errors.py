"""envd's exception tree; the server's interceptor maps each leaf to one gRPC status code."""

from __future__ import annotations


class EnvdError(Exception):
    """Root of every error envd reports to a caller."""


class InvalidRequestError(EnvdError, ValueError):
    """The request itself is wrong (missing command, negative limit, relative path...)."""


class PathError(EnvdError, OSError):
    """A path cannot be used: missing, wrong kind, or reached through a symbolic link."""


class NotFoundError(PathError, FileNotFoundError):
    """The path or process does not exist."""


class SymlinkRefusedError(PathError, PermissionError):
    """The path goes through a symbolic link, which envd never follows."""


class TooLargeError(EnvdError):
    """What a call would make is over the cap it was given (a download's archive)."""
