"""Rollout workers: processes that run rollouts for a control plane, one per core on a host, or Ray actors on many
hosts. `hub` is the control plane's side (an Executor for the job manager), `agent` the worker's, `spawn` starts
and supervises local worker processes, `servicer` serves the worker wire (protos/worker.proto)."""
