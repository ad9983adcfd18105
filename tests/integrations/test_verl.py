"""The verl agent loop (registered as `envfleet`) with a fake server_manager: verl imports on CPU, so the real
AgentLoopBase subclass runs one episode through a real orchestrator's sessions and returns AgentLoopOutput. What
needs a GPU (verl's workers, vLLM/SGLang, the PPO trainer) is not run here."""

from __future__ import annotations

from typing import Any

from orchestrator.server.app import Orchestrator
from orchestrator.service.registry import Registry
from tests.integrations.conftest import ENV, require
from tests.integrations.engine import ScriptedEngine


class FakeServerManager:
    """verl's LLMServerClient as the agent loop calls it: generate(request_id, prompt_ids, sampling_params)."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine
        self.sampling: list[dict[str, Any]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        self.sampling.append(dict(sampling_params))
        s = self.engine.sample(request_id, prompt_ids, int(sampling_params["max_tokens"]))
        return TokenOutput(token_ids=s.ids, log_probs=s.logprobs, stop_reason="completed")


async def test_the_envfleet_agent_loop_runs_an_episode(orchestrator: Orchestrator, registry: Registry) -> None:
    require("verl", "verl")
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, DictConfigWrap, _agent_loop_registry

    from integrations.verl import EnvfleetAgentLoop
    from orchestrator.testing.qwen_like import QWEN_LIKE_DIR

    assert _agent_loop_registry["envfleet"] == {"_target_": "integrations.verl.EnvfleetAgentLoop"}
    tokenizer = AutoTokenizer.from_pretrained(QWEN_LIKE_DIR)
    engine = ScriptedEngine(tokenizer, {t.id: str(t.data["answer"]) for t in registry.get(ENV).tasks()})
    manager = FakeServerManager(engine)
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 1024, "response_length": 768}}})
    loop = EnvfleetAgentLoop(
        trainer_config=DictConfigWrap(config),
        server_manager=manager,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=object,
        data_config=DictConfigWrap(OmegaConf.create({})),
        server=orchestrator.address,
        env=ENV,
        name="envfleet",  # as an agent_loop.yaml entry passes it
    )
    out = await loop.run({"temperature": 1.0}, raw_prompt=[], extra_info={"task_id": "py-005"})
    assert isinstance(out, AgentLoopOutput)
    assert out.reward_score == 1.0 and out.extra_fields["envfleet_status"] == "OK"
    assert out.num_turns == 4  # the prompt, two assistant turns, one tool turn
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs or [])
    first, second = engine.samples
    assert out.prompt_ids == first.prompt_ids
    assert first.request_id == second.request_id and first.request_id.split(":")[1] == "py-005"
    sampled = [i for i, m in zip(out.response_ids, out.response_mask, strict=True) if m == 1]
    assert sampled == first.ids + second.ids  # exactly what the engine sampled
    assert second.prompt_ids == out.prompt_ids + out.response_ids[: len(second.prompt_ids) - len(out.prompt_ids)]
    # the budget handed to the engine shrinks with the episode
    assert manager.sampling[0]["max_tokens"] == 768 and manager.sampling[1]["max_tokens"] < 768
    assert manager.sampling[0]["temperature"] == 1.0
    # verl's own conversion to tensors takes it
    tensors = out.as_dict()
    assert tensors["rm_scores"][-1].item() == 1.0 and tensors["response_mask"].sum().item() == len(sampled)
