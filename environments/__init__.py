"""Built-in environments, one package each (tool use, coding, SWE-style repository tasks)."""
