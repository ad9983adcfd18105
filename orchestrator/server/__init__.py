"""The orchestrator's gRPC server: services, conversion at the wire edge, and error mapping."""
