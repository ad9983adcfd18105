"""The client's decoding of a wire rollout: the model it builds is the one the server stored, field for field."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from orchestrator.client.convert import StepOutcome, _built, rollout_from_pb, step_outcome
from orchestrator.client.sdk import group_result
from orchestrator.core.models import (
    Provenance,
    Rollout,
    RolloutError,
    RolloutStatus,
    Timing,
    Tokens,
    ToolCallRecord,
    Turn,
)
from orchestrator.server.convert import rollout_pb
from protos import orchestrator_pb2 as pb


def _every_field_set(status: RolloutStatus) -> Rollout:
    """A rollout in which no field keeps its default, so a field the decoder forgets shows."""
    return Rollout(
        id="j:t:3",
        job_id="j",
        env="python-tool",
        task_id="t",
        group_id="j:t",
        sample_index=3,
        policy_version="v7",
        status=status,
        reward=0.25 if status.scored else None,
        reward_components={"tests": 0.5},
        metrics={"turns": 2.0},
        turns=[
            Turn(role="system", text="be brief"),
            Turn(role="assistant", tool_calls=[ToolCallRecord(id="c1", name="bash", arguments='{"command": "ls"}')]),
            Turn(role="tool", text="a\n", tool_call_id="c1", name="bash"),
        ],
        tokens=Tokens(
            status="complete",
            prompt_ids=[1, 2],
            completion_ids=[3, 4, 5],
            completion_mask=[1, 0, 1],
            completion_logprobs=[-0.5, 0.0, -1.25],
        ),
        timing=Timing(queue=0.1, sandbox_acquire=0.2, setup=0.3, generation=0.4, tools=0.5, scoring=0.6, total=2.1),
        provenance=Provenance(
            image="img", image_id="sha256:ab", env_version="1", seed=9, policy_model="m", policy_version="v7"
        ),
        error=None if status.scored else RolloutError(kind="SandboxError", message="envd went away"),
        attempts=2,
        seq=11,
        started_at=1.5,
        finished_at=3.5,
    )


@pytest.mark.parametrize("status", [RolloutStatus.OK, RolloutStatus.INFRA_ERROR])
def test_a_decoded_rollout_is_the_stored_one(status: RolloutStatus) -> None:
    stored = _every_field_set(status)
    got = rollout_from_pb(rollout_pb(stored.model_dump_json(), seq=stored.seq))
    assert got == stored
    assert got.model_dump_json() == stored.model_dump_json()
    assert got.model_fields_set == set(Rollout.model_fields)
    assert got.turns[1].tool_calls[0].model_fields_set == set(ToolCallRecord.model_fields)
    got.turns[0].text = "changed"  # a model like any other: its fields assign, its copies are its own
    assert got.model_copy(deep=True).turns[0].text == "changed" and stored.turns[0].text == "be brief"


@pytest.mark.parametrize("model", [Rollout, Turn, ToolCallRecord, Tokens, Timing, Provenance, RolloutError])
def test_built_makes_what_model_construct_makes(model: type[BaseModel]) -> None:
    source = _every_field_set(RolloutStatus.INFRA_ERROR)
    instance = {
        Rollout: source,
        Turn: source.turns[2],
        ToolCallRecord: source.turns[1].tool_calls[0],
        Tokens: source.tokens,
        Timing: source.timing,
        Provenance: source.provenance,
        RolloutError: source.error,
    }[model]
    assert instance is not None
    values = {name: getattr(instance, name) for name in model.model_fields}
    built, constructed = _built(model, dict(values)), model.model_construct(**values)
    assert built == constructed
    assert built.model_fields_set == constructed.model_fields_set
    assert built.__pydantic_extra__ == constructed.__pydantic_extra__
    assert built.__pydantic_private__ == constructed.__pydantic_private__
    assert built.model_dump() == constructed.model_dump()


@pytest.mark.parametrize("value", [0, 99])
def test_a_status_this_client_does_not_know_is_not_scored_and_says_so(value: int) -> None:
    # a bare KeyError (99: a status newer than this client) stopped every reader of the job at that rollout, unsaid;
    # then a ValueError that said why stopped it all the same, at every resume. The contract: not scored
    m = rollout_pb(_every_field_set(RolloutStatus.OK).model_dump_json())
    m.status = value  # type: ignore[assignment]
    r = rollout_from_pb(m)
    assert (r.status, r.reward) == (RolloutStatus.INFRA_ERROR, None) and r.error is not None
    assert r.error.kind == "UnknownStatus" and f"has status {value}, which this client does not know" in r.error.message


def test_a_groups_member_of_a_status_this_client_does_not_know_has_no_advantage_and_counts_failed() -> None:
    # the sample was unscored (rollout_from_pb) but kept the advantage the server gave it, and `failed` did not
    # count it: a trainer reading the advantages trained on a sample whose status said it failed
    member = rollout_pb(_every_field_set(RolloutStatus.OK).model_dump_json())
    newer, known = pb.Rollout(), pb.Rollout()
    newer.CopyFrom(member)
    newer.status = 99  # type: ignore[assignment]
    newer.advantage = 0.5
    known.CopyFrom(member)
    known.advantage = -0.5
    g = pb.Group(group_id="g", task_id="t", failed=0)
    result = group_result(g, [newer, known])
    assert result.advantages == [None, -0.5] and result.failed == 1
    assert [r.status for r in result.rollouts] == [RolloutStatus.INFRA_ERROR, RolloutStatus.OK]


def test_a_steps_status_this_client_does_not_know_is_not_scored() -> None:
    # known_status raised a ValueError out of env.step, the adapters' step and OpenEnv's, mid-episode
    assert step_outcome(pb.StepResponse(reward=0.0)) == StepOutcome(None, 0.0, "", "")
    ok = step_outcome(pb.StepResponse(status=pb.ROLLOUT_STATUS_OK, reward=1.0, terminated=True))
    assert (ok.status, ok.reward) == (RolloutStatus.OK, 1.0)
    newer = step_outcome(pb.StepResponse(status=99, reward=1.0, terminated=True))  # type: ignore[arg-type]
    assert (newer.status, newer.reward, newer.error_kind) == (RolloutStatus.INFRA_ERROR, None, "UnknownStatus")
