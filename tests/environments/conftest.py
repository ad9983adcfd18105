"""The orchestrator fixtures, shared with the environment tests."""

from tests.orchestrator.conftest import client, orchestrator, policy_server, registry, task_ids

__all__ = ["client", "orchestrator", "policy_server", "registry", "task_ids"]
