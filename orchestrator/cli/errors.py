"""The command line's errors (in the one tree: orchestrator/core/errors.py)."""

from __future__ import annotations

from orchestrator.core.errors import InvalidRequestError


class CommandLineError(InvalidRequestError):
    """A flag or argument the command cannot use (an unreadable file, a token that would go out in clear, a name
    where a spec file is needed); the command exits 2 with the message."""
