"""envfleet's orchestrator: sandboxes, scheduling, rollouts and the trainer-facing gRPC services."""
