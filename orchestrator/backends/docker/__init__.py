"""The Docker backend: hardened containers with envd inside, engine calls through a limiter, and a sweeper."""

from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig

__all__ = ["DockerBackend", "DockerBackendConfig"]
