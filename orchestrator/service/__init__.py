"""The fleet's services: jobs, the scheduler, the result store, sessions, raw sandboxes, the environment registry
and registration, tenancy."""
