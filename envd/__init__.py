"""envd: the small daemon inside each sandbox (processes, files, health) over gRPC on a unix socket."""
