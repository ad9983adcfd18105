"""Where a job's rollouts run: in this process (`LocalExecutor`), or on rollout workers (`WorkerHub`, in
orchestrator/worker/hub.py). The job manager sees only this seam."""

from __future__ import annotations

from typing import Protocol

from orchestrator.core.environment import Environment, ImageSource
from orchestrator.core.models import EncodedRollout, JobSpec, Rollout
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.rollout.policy.base import Policy
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.rollout.policy.replay import ReplayPolicy
from orchestrator.rollout.runner import RolloutRunner, WorkItem
from orchestrator.rollout.tito.policy import TitoPolicy
from orchestrator.rollout.tito.tokenizer import TokenizerCache


class Executor(Protocol):
    """Runs rollouts to a scored (or failed) Rollout; never raises for a rollout's own failure."""

    @property
    def images(self) -> ImageSource:
        """The images the control plane builds ahead of a job (readiness gates its queue)."""

    async def run(self, item: WorkItem, env: Environment, spec: JobSpec) -> Rollout | EncodedRollout:
        """One rollout of `item`, with the policy endpoint and version `spec` holds now: a model, or (from a
        worker) the bytes it encoded, checked."""

    def job_ended(self, job_id: str) -> None:
        """Drop what was kept for a finished job (group snapshots)."""

    async def close(self) -> None:
        """Release connections; running rollouts were cancelled by the scheduler before."""


def _client_key(endpoint: PolicyEndpoint) -> PolicyEndpoint:
    return endpoint if endpoint.version == "" else endpoint.model_copy(update={"version": ""})


class LocalExecutor:
    """Rollouts on this process's event loop, through one RolloutRunner (one small policy client per endpoint and
    token mode; tokenizers loaded once per process, from the directories `tokenizers` resolves names in)."""

    def __init__(self, runner: RolloutRunner, tokenizers: TokenizerCache | None = None) -> None:
        self.runner = runner
        self.tokenizers = tokenizers or TokenizerCache()
        self._policies: dict[PolicyEndpoint, OpenAIPolicy] = {}
        self._tito: dict[PolicyEndpoint, TitoPolicy] = {}
        self._replays: dict[str, ReplayPolicy] = {}

    @property
    def images(self) -> ImageSource:
        """The runner's image source."""
        return self.runner.images

    def policy(self, endpoint: PolicyEndpoint) -> OpenAIPolicy:
        """The client of one endpoint, made once: each manages its own small HTTP pools. Made per endpoint less its
        version, which no call sends (a rollout records it): a trainer that calls UpdatePolicy at every step made a
        client, its pools and their sockets, at every step, and none was ever closed."""
        key = _client_key(endpoint)
        policy = self._policies.get(key)
        if policy is None:
            policy = self._policies[key] = OpenAIPolicy(key)
        return policy

    def tito_policy(self, endpoint: PolicyEndpoint) -> TitoPolicy:
        """The token-in, token-out client of one endpoint, made once (its tokenizer loads on first use)."""
        key = _client_key(endpoint)
        policy = self._tito.get(key)
        if policy is None:
            policy = self._tito[key] = TitoPolicy(key, self.tokenizers, http=self.policy(key))
        return policy

    async def run(self, item: WorkItem, env: Environment, spec: JobSpec) -> Rollout:
        """Run the rollout here."""
        policy: Policy
        if spec.policy.base_url == REPLAY_URL:
            policy = self._replay(env)
        elif spec.token_mode == "tito":
            policy = self.tito_policy(spec.policy)
        else:
            policy = self.policy(spec.policy)
        return await self.runner.run(item, env, spec, policy, spec.policy.version)

    def _replay(self, env: Environment) -> ReplayPolicy:
        policy = self._replays.get(env.ref())
        if policy is None:
            policy = self._replays[env.ref()] = ReplayPolicy(env)
        return policy

    def job_ended(self, job_id: str) -> None:
        """Forget the job's group snapshots."""
        self.runner.snapshots.forget_job(job_id)

    async def close(self) -> None:
        """Close every policy client."""
        self._tito = {}  # their transports are the chat clients, closed below
        policies, self._policies = list(self._policies.values()), {}
        for policy in policies:
            await policy.aclose()
