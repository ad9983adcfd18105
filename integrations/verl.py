"""verl: an agent loop registered as `envfleet` that runs each sample as an envfleet session, token in, token out.

verl's engine generates (`server_manager.generate(prompt_ids=...)`), envfleet runs the tools in its sandboxes and
scores the episode with the environment's rubric. Importing this module registers the loop; point verl at it:

    # agent_loop.yaml (actor_rollout_ref.rollout.agent.agent_loop_config_path)
    - name: envfleet
      _target_: integrations.verl.EnvfleetAgentLoop
      server: 127.0.0.1:50051
      env: python-tool
      busy_wait_s: 600     # how long a Reset waits while the fleet is full (0: fail at once)

and give each dataset row `agent_name: envfleet` and `extra_info: {task_id: py-000}` (`env` there overrides the
loop's). The reward is the episode's (`reward_score`); an episode that fails for the fleet's reason is retried on a
fresh session, and one that still has no reward raises EpisodeFailedError: verl's group advantage would count any
number we put there, so there is no honest value to return.
"""

from __future__ import annotations

import os
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from integrations.episode import EpisodeTokens, Generated, run_episode
from integrations.session import AsyncSessions
from orchestrator.client.busy import BUSY_WAIT_S
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.rollout.tito import ChatTemplateTokens, get_parser

DEFAULT_SERVER = "127.0.0.1:50051"


def agent_loop_output(episode: EpisodeTokens) -> AgentLoopOutput:
    """An episode as verl's AgentLoopOutput: the reward on `reward_score`, envfleet's outcome in extra_fields."""
    return AgentLoopOutput(
        prompt_ids=episode.prompt_ids,
        response_ids=episode.response_ids,
        response_mask=episode.response_mask,
        response_logprobs=episode.response_logprobs,
        reward_score=episode.reward,
        num_turns=1 + episode.assistant_turns + episode.tool_turns,
        metrics=AgentLoopMetrics(),
        extra_fields={
            "envfleet_task_id": episode.task_id,
            "envfleet_status": episode.status.value,
            "envfleet_reward_components": episode.reward_components,
            "envfleet_out_of_budget": episode.out_of_budget,
        },
    )


@register("envfleet")
class EnvfleetAgentLoop(AgentLoopBase):  # type: ignore[misc]
    """Runs one envfleet session per sample with verl's engine as the policy (token in, token out)."""

    def __init__(
        self,
        *args: Any,
        server: str = "",
        env: str = "",
        token: str | None = None,
        tool_parser: str = "hermes",
        infra_retries: int = 1,
        busy_wait_s: float = BUSY_WAIT_S,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("name", None)  # the agent_loop.yaml entry's name arrives as a keyword
        kwargs.pop("tools", None)  # verl's own tools: envfleet's environment brings its tools
        super().__init__(*args, **kwargs)
        self.server = server or os.environ.get("ENVFLEET_SERVER", DEFAULT_SERVER)
        self.env = env or os.environ.get("ENVFLEET_ENV", "")
        self.token = token or os.environ.get("ENVFLEET_TOKEN") or None
        self.parser = get_parser(tool_parser)
        self.infra_retries = infra_retries
        self.busy_wait_s = float(busy_wait_s)
        # the data config's apply_chat_template_kwargs (enable_thinking=False, say): the episode renders its prompt and
        # observations as verl renders its own prompts
        self.tokens = ChatTemplateTokens(self.tokenizer, getattr(self, "apply_chat_template_kwargs", None))
        self.response_length = int(self.rollout_config.response_length)
        self.prompt_length = int(self.rollout_config.prompt_length)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """One episode on the row's task (`extra_info.task_id`, or a task drawn with `extra_info.seed`)."""
        extra = dict(kwargs.get("extra_info") or {})
        env = str(extra.get("env") or self.env)
        if not env:
            raise ValueError("no envfleet environment: set `env` in agent_loop.yaml, or extra_info.env in the data")
        task_id = str(extra.get("task_id", ""))
        seed = extra.get("seed")
        # "<episode>:<task>:0", the shape of a rollout id: sticky per episode, and a server's log names the task
        request_id = f"{uuid4().hex}:{task_id}:0"

        async def generate(prompt_ids: list[int], max_tokens: int) -> Generated:
            out = await self.server_manager.generate(
                request_id=request_id,
                prompt_ids=prompt_ids,
                sampling_params={**sampling_params, "max_tokens": max_tokens},
            )
            logprobs = list(out.log_probs) if out.log_probs is not None else None
            # verl's TokenOutput says "aborted" for a request its weight sync cut (older versions say nothing)
            stop = getattr(out, "stop_reason", None)
            return Generated(list(out.token_ids), logprobs, stop if isinstance(stop, str) else None)

        async with EnvfleetClient(self.server, token=self.token) as client:
            episode = await run_episode(
                AsyncSessions(client, busy_wait_s=self.busy_wait_s),
                self.tokens,
                self.parser,
                generate,
                env=env,
                task_id=task_id,
                seed=int(seed) if seed is not None else None,
                response_length=self.response_length,
                infra_retries=self.infra_retries,
                prompt_length=self.prompt_length,
            )
        return agent_loop_output(episode)
