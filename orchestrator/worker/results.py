"""Rollouts across the worker wire. A worker encodes each rollout once, in both forms the control plane keeps: JSON for
the result log, the trainer's protobuf for the stream. The control plane checks the fields it must trust and passes
the bytes on, decoded no further and never encoded again.

What is checked, on the protobuf form (the one the trainer reads): both forms are there and within size, and it
parses; the ids are the assignment's (a worker cannot write into another rollout, job or tenant); the status is
known and a reward comes with a scored status only (no failure passes as reward 0). The JSON of this host's own
worker processes (unix socket) is stored unread: both forms come from one model (`encode`). A remote worker (TCP:
another host, a Ray actor) is trusted less: its JSON is validated whole, as a Rollout, with every number finite, must
agree with the protobuf form on all of the above, and both forms kept are the control plane's own serializations of
that model (the worker's protobuf form is checked and dropped).
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from orchestrator.client.convert import ROLLOUT_STATUS_FROM_PB
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.models import EncodedRollout, Rollout, check_reward
from orchestrator.rollout.runner import WorkItem
from orchestrator.server.convert import rollout_pb
from protos import orchestrator_pb2 as pb
from protos import worker_pb2 as wpb

MAX_WIRE_BYTES = 64 << 20  # one message of the worker wire, either way (the control plane's and the worker's channel)
MAX_ROLLOUT_BYTES = 16 << 20  # each form of a rollout, well inside one message


class InvalidResultError(InvalidRequestError):
    """A worker's rollout that the control plane refuses (wrong ids, a reward without a score, too large...)."""


def encode(assignment_id: str, rollout: Rollout) -> wpb.RolloutResult:
    """A worker's result: the rollout in both forms, each encoded once."""
    js = rollout.model_dump_json(exclude={"seq"})
    return wpb.RolloutResult(
        assignment_id=assignment_id, rollout_json=js.encode(), rollout_pb=rollout_pb(js).SerializeToString()
    )


def decode(result: wpb.RolloutResult, item: WorkItem, *, trusted: bool) -> tuple[EncodedRollout, float]:
    """The checked rollout of a worker's result for `item`, and its run time (seconds); InvalidResultError names
    what is wrong."""
    js, wire_bytes = result.rollout_json, result.rollout_pb  # each read of a bytes field copies it
    for name, data in (("JSON", js), ("protobuf", wire_bytes)):
        if not data:
            raise InvalidResultError(f"the rollout's {name} form is missing")
        if len(data) > MAX_ROLLOUT_BYTES:
            raise InvalidResultError(f"the rollout's {name} form is {len(data)} bytes, over {MAX_ROLLOUT_BYTES}")
    try:
        wire = pb.Rollout.FromString(wire_bytes)
    except DecodeError as e:
        raise InvalidResultError(f"the rollout's protobuf form does not parse: {e}") from None
    status = ROLLOUT_STATUS_FROM_PB.get(wire.status)
    if status is None:
        raise InvalidResultError(f"unknown rollout status {wire.status}")
    if wire.seq or wire.HasField("advantage"):
        raise InvalidResultError("seq and advantage are the control plane's to set")
    got = (wire.id, wire.job_id, wire.task_id, wire.group_id, wire.sample_index)
    want = (item.id, item.job_id, item.task.id, item.group_id, item.sample_index)
    if got != want:
        raise InvalidResultError(f"the rollout is {got[0]!r} of job {got[1]!r}; the assignment was {want[0]!r}")
    ids = (item.id, item.job_id, item.group_id)
    reward = wire.reward if wire.HasField("reward") else None
    try:
        check_reward(status, reward)
    except ValueError as e:
        raise InvalidResultError(str(e)) from None
    try:
        if trusted:  # both forms come from one model in a process of this host's own (encode above)
            return EncodedRollout(*ids, status, reward, wire.attempts, js.decode(), wire_bytes), wire.timing.total
        model = Rollout.model_validate_json(js)
    except ValueError as e:  # pydantic's ValidationError and UnicodeDecodeError are ValueErrors
        raise InvalidResultError(f"the rollout's JSON form is invalid: {e}") from None
    if (model.id, model.job_id, model.task_id, model.group_id, model.sample_index, model.status, model.reward) != (
        *want,
        status,
        reward,
    ):
        raise InvalidResultError("the rollout's JSON and protobuf forms disagree on its ids, status or reward")
    json = model.model_dump_json(exclude={"seq"})
    try:  # a NaN or an infinity (JSON's NaN, 1e999) is written as null, which no float field takes back
        Rollout.model_validate_json(json)
    except ValueError:
        raise InvalidResultError(
            "the rollout's JSON form holds a number that is not finite (NaN or infinity)"
        ) from None
    # the trainer's form is made here from the checked model, not passed on as the worker sent it (its token ids,
    # logprobs and metrics were never compared with the JSON's)
    return EncodedRollout(
        *ids, status, reward, model.attempts, json, rollout_pb(json).SerializeToString()
    ), model.timing.total


def add_attempts(rollout: EncodedRollout, extra: int) -> EncodedRollout:
    """The rollout with `extra` more attempts counted (its earlier workers were lost): both forms again."""
    model = Rollout.model_validate_json(rollout.json)
    model.attempts += extra
    wire = pb.Rollout.FromString(rollout.wire)
    wire.attempts = model.attempts
    return EncodedRollout(
        rollout.id,
        rollout.job_id,
        rollout.group_id,
        rollout.status,
        rollout.reward,
        model.attempts,
        model.model_dump_json(exclude={"seq"}),
        wire.SerializeToString(),
    )
