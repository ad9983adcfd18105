"""Tests of orchestrator.rollout."""
