"""Optional adapters to other ecosystems' contracts (each behind its own extra, imported only when asked for)."""
