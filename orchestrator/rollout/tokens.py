"""Flat token arrays across the turns of an episode, exact or absent.

Turn k's prompt must extend turn k-1's prompt plus its completion; the extension is the observation (tool results
and chat template glue) and gets mask 0. When a server returns no ids, or a later prompt does not extend the earlier
one, the arrays are dropped and the status says why: tokens are never invented. Ids and logprobs that the wire
cannot carry exactly end the episode (PolicyTokenError, POLICY_ERROR): they are never clamped to fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.core.models import Tokens, TokenStatus
from orchestrator.rollout.policy import token_checks as checks
from orchestrator.rollout.policy.base import Completion

# The values of Tokens.status (a Literal there too; tests/orchestrator/rollout/test_tokens.py keeps the two equal).


@dataclass
class TokenTracker:
    """Accumulates one episode's tokens, completion by completion."""

    status: TokenStatus = "complete"
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    _turns: int = 0

    def add(self, c: Completion) -> None:
        """Fold in one completion (and the observation before it). PolicyTokenError when what would be kept is not
        exact values the wire can carry: the parsers check each answer already, this holds for any Policy."""
        self._turns += 1
        if self.status != "complete":
            return
        if c.prompt_ids is None or c.completion_ids is None or c.logprobs is None:
            self._drop("missing")
            return
        completion = checks.token_ids(c.completion_ids, "completion ids") or []
        logprobs = checks.logprobs(c.logprobs, "logprobs[{i}]")
        checks.same_length(completion, logprobs, "completion ids", "logprobs")
        if self._turns == 1:
            self.prompt_ids = checks.token_ids(c.prompt_ids, "prompt ids") or []
        else:
            seen = len(self.prompt_ids) + len(self.completion_ids)
            if c.prompt_ids[: len(self.prompt_ids)] != self.prompt_ids or (
                c.prompt_ids[len(self.prompt_ids) : seen] != self.completion_ids
            ):
                self._drop("inconsistent")
                return
            # only the observation is new: what it extends was checked when it came
            observation = checks.token_ids(c.prompt_ids[seen:], "prompt ids", offset=seen) or []
            self.completion_ids += observation
            self.mask += [0] * len(observation)
            self.logprobs += [0.0] * len(observation)
        self.completion_ids += completion
        self.mask += [1] * len(completion)
        self.logprobs += logprobs

    def count(self) -> int:
        """How many tokens the episode holds so far."""
        return len(self.prompt_ids) + len(self.completion_ids)

    def count_with(self, c: Completion) -> int:
        """How many it would hold with `c` added (its prompt extends everything before it)."""
        return max(self.count(), len(c.prompt_ids or ())) + len(c.completion_ids or ())

    def _drop(self, status: TokenStatus) -> None:
        self.status = status
        self.prompt_ids, self.completion_ids, self.mask, self.logprobs = [], [], [], []

    def result(self) -> Tokens:
        """The Tokens of the episode so far."""
        if self._turns == 0:
            return Tokens(status="missing")
        return Tokens(
            status=self.status,
            prompt_ids=self.prompt_ids,
            completion_ids=self.completion_ids,
            completion_mask=self.mask,
            completion_logprobs=self.logprobs,
        )
