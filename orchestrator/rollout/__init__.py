"""The rollout runner: the policy seam and the agent loop between a policy and a sandbox."""
