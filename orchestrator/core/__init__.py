"""Core types shared by every layer: errors, models, the sandbox and environment interfaces, image specs, policy
configuration. Imports no Docker, httpx or SQLite (a test checks it)."""
