"""A job's chat template variables (policy.chat_template_kwargs: Qwen3's {"enable_thinking": false}): tito renders
every prompt and observation with them, chat mode sends them for the server to render with. The fleet had no way to
pass them: a Qwen3 policy trained with thinking off was rolled out with it on. Real gRPC, jobs and the Qwen-like model
server double on the fake backend."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.server.convert import job_spec_from_pb
from orchestrator.service.registry import Registry
from orchestrator.testing.qwen_like import QWEN_LIKE_DIR
from orchestrator.testing.scripted_policy import Script, Step, start_scripted_server
from tests.orchestrator.servers import FAKE, serve

pytest.importorskip("transformers")

NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.parametrize("token_mode", ["chat", "tito"])
async def test_the_templates_variables_render_every_prompt(tmp_path: Path, token_mode: str) -> None:
    from transformers import AutoTokenizer

    env = Registry.from_entry_points().get("python-tool")
    task = next(t for t in env.tasks() if t.id == "py-004")
    script = Script(template="qwen3", model="qwen-like", tasks={task.id: [Step(content=str(task.data["answer"]))]})
    server = await start_scripted_server(script)
    try:
        async with (
            serve(tmp_path / "data", backend=FAKE, tokenizer_dirs=[QWEN_LIKE_DIR.parent]) as orch,
            EnvfleetClient(orch.address) as client,
        ):
            policy = PolicyEndpoint(
                base_url=server.url,
                model="qwen-like",
                tokenizer=QWEN_LIKE_DIR.name,
                chat_template_kwargs={"enable_thinking": False},
            )
            spec = JobSpec(
                env="python-tool", tasks=TaskSelection(kind="ids", ids=[task.id]), policy=policy, token_mode=token_mode
            )
            (rollout,) = [r async for r in client.rollouts(await client.submit(spec))]
    finally:
        await server.close()
    assert rollout.status.value == "OK" and rollout.reward == 1.0, rollout.error
    tokenizer = AutoTokenizer.from_pretrained(QWEN_LIKE_DIR)
    (sample,) = server.samples
    # the prompt the server sampled after: rendered by the fleet (tito) or by the server (chat), thinking off
    assert str(tokenizer.decode(sample.prompt_ids)).endswith(NO_THINK)
    assert str(tokenizer.decode(rollout.tokens.prompt_ids)).endswith(NO_THINK)


def test_the_variables_cross_the_wire_and_bad_ones_are_refused() -> None:
    policy = PolicyEndpoint(base_url="http://h/v1", chat_template_kwargs='{"enable_thinking": false}')
    assert policy.template_kwargs == {"enable_thinking": False}
    from orchestrator.client.convert import job_spec_to_pb

    wire = job_spec_to_pb(JobSpec(env="e", policy=policy))
    assert wire.policy.chat_template_kwargs == '{"enable_thinking":false}'
    assert job_spec_from_pb(wire).policy == policy
    for bad, says in (
        ("[1]", "must be a JSON object"),
        ("{", "is not JSON"),
        ('{"add_generation_prompt": false}', "which the fleet sets itself"),
    ):
        with pytest.raises(ValueError, match=says):
            PolicyEndpoint(base_url="http://h/v1", chat_template_kwargs=bad)


async def test_a_submit_with_bad_variables_says_what_to_fix(tmp_path: Path) -> None:
    from orchestrator.client.convert import job_spec_to_pb

    async with serve(tmp_path / "data", backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        wire = job_spec_to_pb(JobSpec(env="python-tool", policy=PolicyEndpoint(base_url="http://h/v1")))
        wire.policy.chat_template_kwargs = "[1]"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.rollout_stub.SubmitJob(wire)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat_template_kwargs must be a JSON object" in str(e.value.details())
