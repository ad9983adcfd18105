"""The `envfleet` command. `main` builds the parser; plug-ins add subcommands through the `envfleet.cli` entry
point group."""
