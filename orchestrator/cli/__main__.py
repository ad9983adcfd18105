"""`python -m orchestrator.cli`."""

from orchestrator.cli.main import main

main()
