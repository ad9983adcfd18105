"""Sandbox backends: the SandboxBackend/Sandbox seam and its implementations (one module each)."""
