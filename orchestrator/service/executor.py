"""Where a job's rollouts run: in this process (`LocalExecutor`), or on rollout workers (`WorkerHub`, in
orchestrator/worker/hub.py). The job manager sees only this seam."""

from __future__ import annotations

import asyncio
import collections
import weakref
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


# Policy clients kept: a tenant names endpoints (base URL, model, API key: each its own client, with its HTTP pools
# and, for HTTPS, an SSL context); past this many the least recently used idle ones are closed.
MAX_POLICY_CLIENTS = 64


def _client_key(endpoint: PolicyEndpoint) -> PolicyEndpoint:
    return endpoint if endpoint.version == "" else endpoint.model_copy(update={"version": ""})


class LocalExecutor:
    """Rollouts on this process's event loop, through one RolloutRunner (one small policy client per endpoint and
    token mode; tokenizers loaded once per process, from the directories `tokenizers` resolves names in)."""

    def __init__(self, runner: RolloutRunner, tokenizers: TokenizerCache | None = None) -> None:
        self.runner = runner
        self.tokenizers = tokenizers or TokenizerCache()
        self._policies: collections.OrderedDict[PolicyEndpoint, OpenAIPolicy] = collections.OrderedDict()
        self._tito: dict[PolicyEndpoint, TitoPolicy] = {}
        # by the environment object, gone with it: by name@version, a worker kept every replayed environment's tasks
        # for life, and replayed an older object's references for a newer one of the same name (another spec digest)
        self._replays: weakref.WeakKeyDictionary[Environment, ReplayPolicy] = weakref.WeakKeyDictionary()
        self._running: collections.Counter[PolicyEndpoint] = collections.Counter()  # rollouts using each client
        self._closing: set[asyncio.Future[None]] = set()

    @property
    def images(self) -> ImageSource:
        """The runner's image source."""
        return self.runner.images

    @property
    def open_clients(self) -> int:
        """How many policy clients are open (at most MAX_POLICY_CLIENTS, and those rollouts use now)."""
        return len(self._policies)

    def policy(self, endpoint: PolicyEndpoint) -> OpenAIPolicy:
        """The client of one endpoint, made once: each manages its own small HTTP pools. Made per endpoint less its
        version, which no call sends (a rollout records it): a trainer that calls UpdatePolicy at every step made a
        client, its pools and their sockets, at every step, and none was ever closed."""
        key = _client_key(endpoint)
        policy = self._policies.get(key)
        if policy is None:
            policy = self._policies[key] = OpenAIPolicy(key)
        self._policies.move_to_end(key)
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
            return await self.runner.run(item, env, spec, self._replay(env), spec.policy.version)
        key = _client_key(spec.policy)
        policy = self.tito_policy(key) if spec.token_mode == "tito" else self.policy(key)
        self._running[key] += 1
        try:
            return await self.runner.run(item, env, spec, policy, spec.policy.version)
        finally:
            self._running[key] -= 1
            if not self._running[key]:
                del self._running[key]
            self._close_idle()

    def _close_idle(self) -> None:
        """Past MAX_POLICY_CLIENTS, close the least recently used clients no rollout uses now (in the background:
        the rollout that ended is not held by it)."""
        over = len(self._policies) - MAX_POLICY_CLIENTS
        if over <= 0:  # the common case, at the end of every rollout: no walk over the clients
            return
        for key in [k for k in self._policies if k not in self._running][:over]:
            self._tito.pop(key, None)  # its transport is the chat client, closed here
            closing = asyncio.ensure_future(self._policies.pop(key).aclose())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _replay(self, env: Environment) -> ReplayPolicy:
        policy = self._replays.get(env)
        if policy is None:
            policy = self._replays[env] = ReplayPolicy(env)
        return policy

    def job_ended(self, job_id: str) -> None:
        """Forget the job's group snapshots."""
        self.runner.snapshots.forget_job(job_id)

    async def close(self) -> None:
        """Close every policy client."""
        self._tito = {}  # their transports are the chat clients, closed below
        policies = list(self._policies.values())
        self._policies.clear()
        for policy in policies:
            await policy.aclose()
        await asyncio.gather(*self._closing)
