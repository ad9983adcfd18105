"""The fake backend: in-process sandboxes for control-plane tests and fleet simulations (`envfleet serve --backend
fake`). It imports no docker and runs no command anywhere: exec output comes from an `exec_handler` (tests), from
scripted rules (command-line regex -> stdout, stderr, exit code) or is an echo; files live in memory.

What a fake rollout's reward means: nothing about any policy. A rubric that only reads the submitted answer (python-
tool's exact match) scores what the policy submitted; anything that reads command output scores the echo or the
script. Use it to test jobs, delivery, sessions and scheduling, and to simulate fleets; never to evaluate a model.
"""

from orchestrator.backends.fake.backend import FakeBackend, FakeImages, FakeSandbox
from orchestrator.backends.fake.machine import FakeExec, FakeMachine

__all__ = ["FakeBackend", "FakeExec", "FakeImages", "FakeMachine", "FakeSandbox"]
