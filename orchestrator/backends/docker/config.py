"""The docker backend's settings. The model lives beside the other backends' configs (orchestrator/backends/config.py),
so that choosing a backend imports no docker."""

from orchestrator.backends.config import DockerBackendConfig

__all__ = ["DockerBackendConfig"]
