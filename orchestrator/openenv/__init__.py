"""envfleet sessions behind OpenEnv's server classes (the `openenv` extra).

Each environment is served by OpenEnv's own `create_fastapi_app` under `/envs/<name>[@version]`: its `/ws` session
protocol (reset, step, state, close), and `/health`, `/schema`, `/metadata`. An episode is one envfleet session,
driven through the gRPC SessionService with the caller's own bearer token, so the orchestrator authenticates every
call and keeps tenants apart. `config` imports nothing of OpenEnv; `serving.start_facade` (and everything below it)
does, so a server without the facade never loads it.
"""
