"""Trainer adapters, each an optional extra: TRL (`integrations.trl`, a GRPOTrainer rollout_func over a job), verl
(`integrations.verl`, an agent loop over sessions) and SkyRL (`integrations.skyrl`, a skyrl_gym env over sessions).

They sit on the trainer SDK (orchestrator.client), the core types and the tokenizer-only tito modules, never on the
server stack (tests/test_architecture.py checks it). Importing this package imports no trainer.
"""
