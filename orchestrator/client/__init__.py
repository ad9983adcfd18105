"""The trainer SDK. It imports grpc, protobuf, pydantic, the generated protos and `orchestrator.core` types only:
no Docker, SQLite, httpx or server code (a test checks it)."""

from orchestrator.client.auth import ClientTLS
from orchestrator.client.sdk import EnvfleetClient, GroupResult, SyncEnvfleetClient

__all__ = ["ClientTLS", "EnvfleetClient", "GroupResult", "SyncEnvfleetClient"]
