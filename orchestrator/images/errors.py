"""Errors of the image pipeline."""

from __future__ import annotations

from pathlib import Path

from orchestrator.errors import EnvfleetError


class ImageBuildError(EnvfleetError, RuntimeError):
    """An image could not be built; the message names the failing step and ends with the log's tail."""

    def __init__(self, message: str, *, log_path: Path | None = None, step: str | None = None) -> None:
        super().__init__(message)
        self.log_path = log_path
        self.step = step
