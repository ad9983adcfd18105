"""The verl agent loop (registered as `envfleet`) with a fake server_manager that hands each generate call to the
model server double's /v1/completions: verl imports on CPU, so the real AgentLoopBase subclass runs episodes
through a real orchestrator's sessions and returns AgentLoopOutput, with the double's ids and logprobs. An episode
whose sandbox dies is retried once on a fresh session, then raises. What needs a GPU (verl's workers, vLLM/SGLang,
the PPO trainer) is not run here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.backends.fake.backend import FakeBackend
from orchestrator.backends.fake.machine import FakeExec
from orchestrator.core.errors import EpisodeFailedError, SandboxDiedError
from orchestrator.core.sandbox import ExecResult
from orchestrator.server.app import Orchestrator
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import ScriptedServer
from tests.integrations.conftest import ENV, require, serve
from tests.integrations.engine import DoubleEngine
from tests.integrations.exact import assert_sampled, observation_text, samples_of

RESPONSE_LENGTH = 768


class FakeServerManager:
    """verl's LLMServerClient as the agent loop calls it: generate(request_id, prompt_ids, sampling_params), here
    answered by the double."""

    def __init__(self, engine: DoubleEngine) -> None:
        self.engine = engine
        self.sampling: list[dict[str, Any]] = []
        self.request_ids: list[str] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        self.sampling.append(dict(sampling_params))
        self.request_ids.append(request_id)
        out = await self.engine.generate(request_id, prompt_ids, int(sampling_params["max_tokens"]))
        return TokenOutput(token_ids=out.ids, log_probs=out.logprobs, stop_reason="completed")


@pytest.fixture
async def manager(qwen_server: ScriptedServer) -> AsyncIterator[FakeServerManager]:
    require("verl", "verl")
    async with httpx.AsyncClient() as http:
        yield FakeServerManager(DoubleEngine(qwen_server, http))


def _loop(orchestrator: Orchestrator, manager: FakeServerManager) -> Any:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from integrations.verl import EnvfleetAgentLoop
    from orchestrator.testing.qwen_like import QWEN_LIKE_DIR

    rollout = {"prompt_length": 1024, "response_length": RESPONSE_LENGTH}
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})
    return EnvfleetAgentLoop(
        trainer_config=DictConfigWrap(config),
        server_manager=manager,
        tokenizer=AutoTokenizer.from_pretrained(QWEN_LIKE_DIR),
        processor=None,
        dataset_cls=object,
        data_config=DictConfigWrap(OmegaConf.create({})),
        server=orchestrator.address,
        env=ENV,
        name="envfleet",  # as an agent_loop.yaml entry passes it
    )


async def test_the_envfleet_agent_loop_runs_an_episode(
    orchestrator: Orchestrator, manager: FakeServerManager, registry: Registry
) -> None:
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, _agent_loop_registry

    import integrations.verl  # noqa: F401  (importing it registers the loop)

    assert _agent_loop_registry["envfleet"] == {"_target_": "integrations.verl.EnvfleetAgentLoop"}
    loop = _loop(orchestrator, manager)
    out = await loop.run({"temperature": 1.0}, raw_prompt=[], extra_info={"task_id": "py-005"})
    assert isinstance(out, AgentLoopOutput)
    assert out.reward_score == 1.0 and out.extra_fields["envfleet_status"] == "OK"
    assert out.num_turns == 4  # the prompt, two assistant turns, one tool turn
    (request_id,) = set(manager.request_ids)  # one sticky request id per episode, naming the task
    assert request_id.split(":")[1] == "py-005"
    samples = samples_of(manager.engine.server, request_id)
    assert [s.turn for s in samples] == [0, 1]
    # exactly what the double sampled (ids, logprobs), the mask 1 on those ids only; the observation the template's
    (observation,) = assert_sampled(out.prompt_ids, out.response_ids, out.response_mask, out.response_logprobs, samples)
    task = next(t for t in registry.get(ENV).tasks() if t.id == "py-005")
    assert observation == loop.tokens.encode(observation_text(str(task.reference[0].arguments["code"])))
    # the budget handed to the engine shrinks with the episode
    assert manager.sampling[0]["max_tokens"] == RESPONSE_LENGTH
    assert manager.sampling[1]["max_tokens"] == RESPONSE_LENGTH - len(samples[0].ids) - len(observation)
    assert manager.sampling[0]["temperature"] == 1.0
    # verl's own conversion to tensors takes it
    tensors = out.as_dict()
    sampled = sum(len(s.ids) for s in samples)
    assert tensors["rm_scores"][-1].item() == 1.0 and tensors["response_mask"].sum().item() == sampled


def _python_breaks(backend: list[FakeBackend], sandboxes: list[str], broken: int | None) -> Any:
    """An exec handler: the python tool kills its sandbox (the first `broken` sandboxes to run one; None: all), as a
    sandbox killed from outside mid-episode; every other command is echoed. `sandboxes` records who ran python."""

    async def handler(cmd: FakeExec) -> ExecResult:
        if "python" not in cmd.command_line:
            return ExecResult(0, cmd.stdin or (cmd.command_line + "\n").encode(), b"")
        if cmd.sandbox_name not in sandboxes:
            sandboxes.append(cmd.sandbox_name)
        if broken is None or sandboxes.index(cmd.sandbox_name) < broken:
            (victim,) = [s.id for s in await backend[0].list_owned() if s.name == cmd.sandbox_name]
            backend[0].kill(victim)
            raise SandboxDiedError(f"sandbox {cmd.sandbox_name} was killed")
        return ExecResult(0, cmd.stdin, b"")

    return handler


async def test_an_episode_whose_sandbox_dies_is_retried_once_on_a_fresh_session(
    tmp_path: Path, manager: FakeServerManager
) -> None:
    backend: list[FakeBackend] = []
    sandboxes: list[str] = []
    async with serve(tmp_path / "data", exec_handler=_python_breaks(backend, sandboxes, broken=1)) as orch:
        assert isinstance(orch.backend, FakeBackend)
        backend.append(orch.backend)
        out = await _loop(orch, manager).run({}, raw_prompt=[], extra_info={"task_id": "py-005"})
        assert orch.sessions is not None and orch.sessions.open_sessions() == 0  # both sessions closed
    assert out.reward_score == 1.0 and out.extra_fields["envfleet_status"] == "OK"
    assert len(sandboxes) == 2  # the killed one, then a fresh one
    # the failed try left nothing in the output: the same sticky request id sampled turn 0 twice (the double reads
    # the turn off the prompt), and the output is the fresh try's samples alone
    (request_id,) = set(manager.request_ids)
    samples = samples_of(manager.engine.server, request_id)
    assert [s.turn for s in samples] == [0, 0, 1]
    assert_sampled(out.prompt_ids, out.response_ids, out.response_mask, out.response_logprobs, samples[1:])


async def test_an_episode_that_fails_again_raises_instead_of_scoring(
    tmp_path: Path, manager: FakeServerManager
) -> None:
    backend: list[FakeBackend] = []
    sandboxes: list[str] = []
    async with serve(tmp_path / "data", exec_handler=_python_breaks(backend, sandboxes, broken=None)) as orch:
        assert isinstance(orch.backend, FakeBackend)
        backend.append(orch.backend)
        with pytest.raises(EpisodeFailedError, match="INFRA_ERROR: SandboxDiedError") as failed:
            await _loop(orch, manager).run({}, raw_prompt=[], extra_info={"task_id": "py-005"})
        assert orch.sessions is not None and orch.sessions.open_sessions() == 0
    assert failed.value.status == "INFRA_ERROR"
    assert len(sandboxes) == 2  # retried once (infra_retries=1), each time on a fresh sandbox, then no more
    (request_id,) = set(manager.request_ids)
    assert [s.turn for s in samples_of(manager.engine.server, request_id)] == [0, 0]
